"""TEST DOUBLE: a serving engine on loopback that speaks vLLM's or SGLang's client contract, as a base
server or as a speculative one, with scripted acceptance. No model: the output for a prompt is a fixed
function of its token ids, and a speculative server "verifies" in rounds that add ACCEPT_CYCLE tokens.

Fields, from each engine's documentation (../shared/reference/sglang-0.5.23.md; vLLM's metrics docs):
- vLLM: streamed `/v1/completions` (SSE `data:` chunks with choices[].text, a last chunk with `usage`
  when stream_options.include_usage, then `data: [DONE]`); `/metrics` with Prometheus counters
  `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
  `..._num_accepted_tokens_per_pos_total{position}`, one series per engine (data parallel: 2 here) and
  model, with `# HELP`/`# TYPE` lines and `_created` samples as prometheus_client writes them; with
  `per_request_metrics` (vLLM's --per-request-spec-decode-metrics summary) the usage chunk also carries
  `metrics.speculative_decoding` (SpeculativeDecodingMetrics of vLLM 0.33's protocol.py: num_spec_steps,
  num_accepted_draft_tokens, mean_acceptance_length, ...; names checked in tests/test_server_eval.py).
- both: `/v1/models` (the OpenAI model list: the served model's id).
- SGLang: streamed `/generate` with `input_ids` (SSE chunks whose `text` is cumulative and whose
  `meta_info` carries prompt_tokens, completion_tokens, spec_verify_ct, spec_accept_length).
"""

from __future__ import annotations

import json
import threading
import time

from tests.loopback_http import LoopbackServer, QuietHandler

ACCEPT_CYCLE = [3, 1, 2, 4]  # tokens each verification adds (accepted drafts + the bonus token)


def scripted_words(ids: list[int], n: int) -> list[str]:
    return [f" w{(sum(ids) * 31 + 7 * i) % 1000}" for i in range(n)]


def rounds(n: int, k: int) -> list[int]:
    """Tokens per verification for an n-token answer (the first token comes from prefill)."""
    out, left, i = [], n - 1, 0
    while left > 0:
        out.append(min(ACCEPT_CYCLE[i % len(ACCEPT_CYCLE)], k + 1, left))
        left -= out[-1]
        i += 1
    return out


class FakeSpecServer(LoopbackServer):
    def __init__(self, engine: str, speculative: bool, k: int = 3, model: str = "/models/target",
                 per_request_metrics: bool = False):
        assert engine in ("vllm", "sglang")
        self.engine, self.speculative, self.k, self.model = engine, speculative, k, model
        self.per_request_metrics = per_request_metrics  # vLLM's --per-request-spec-decode-metrics summary
        self.lock = threading.Lock()
        self.drafts, self.accepted = [0, 0], [0, 0]  # per data-parallel engine
        self.per_pos = [[0] * k, [0] * k]
        self.requests = 0
        self.arrivals: list[float] = []  # when each completion request came in
        server = self

        class Handler(QuietHandler):
            def do_GET(self):
                if self.path == "/v1/models":  # both engines: the OpenAI model list names what is served
                    body = {"object": "list", "data": [{"id": server.model, "object": "model"}]}
                    return self.reply(200, json.dumps(body).encode())
                if self.path != "/metrics" or server.engine != "vllm":
                    return self.reply(404, b"not found", "text/plain")
                return self.reply(200, server.metrics().encode(), "text/plain; version=0.0.4")

            def do_POST(self):
                server.arrivals.append(time.monotonic())
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.engine == "vllm" and self.path == "/v1/completions":
                    chunks = server.vllm_chunks(body)
                elif server.engine == "sglang" and self.path == "/generate":
                    chunks = server.sglang_chunks(body)
                else:
                    return self.reply(404, b'{"error": "unknown path"}')
                payload = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                return self.reply(200, payload.encode(), "text/event-stream")

        self.serve(Handler)
        self.url = f"http://127.0.0.1:{self.port}"

    def _decode(self, ids: list[int], n: int) -> tuple[list[str], list[int]]:
        words = scripted_words(ids, n)
        steps = rounds(n, self.k) if self.speculative else []
        with self.lock:
            e = self.requests % 2  # requests alternate between the two data-parallel engines
            self.requests += 1
            for t in steps:
                self.drafts[e] += 1
                self.accepted[e] += t - 1
                for pos in range(t - 1):
                    self.per_pos[e][pos] += 1
        return words, steps

    def vllm_chunks(self, body: dict) -> list[dict]:
        words, steps = self._decode(body["prompt"], body["max_tokens"])
        chunks = [{"object": "text_completion", "choices": [{"index": 0, "text": w, "finish_reason": None}]}
                  for w in words]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        if body.get("stream_options", {}).get("include_usage"):
            chunks.append({"object": "text_completion", "choices": [],
                           "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(words)}})
            if self.speculative and self.per_request_metrics:  # vLLM's SpeculativeDecodingMetrics, final chunk only
                chunks[-1]["metrics"] = {"speculative_decoding": {
                    "num_spec_steps": len(steps), "num_accepted_draft_tokens": len(words) - 1 - len(steps),
                    "mean_acceptance_length": 1 + (len(words) - 1 - len(steps)) / len(steps),
                    "num_spec_tokens": self.k}}
        return chunks

    def sglang_chunks(self, body: dict) -> list[dict]:
        n = body["sampling_params"]["max_new_tokens"]
        words, steps = self._decode(body["input_ids"], n)
        chunks = []
        for i in range(1, len(words) + 1):
            meta = {"id": "r", "prompt_tokens": len(body["input_ids"]), "completion_tokens": i,
                    "finish_reason": {"type": "length", "length": n} if i == len(words) else None}
            if self.speculative:
                verify = len(steps) if i == len(words) else 0
                meta.update(spec_verify_ct=verify, spec_accept_length=i / verify if verify else 0.0)
            chunks.append({"text": "".join(words[:i]), "meta_info": meta})
        return chunks

    def metrics(self) -> str:
        lines = []
        for name, values in (("spec_decode_num_drafts", self.drafts), ("spec_decode_num_accepted_tokens",
                                                                        self.accepted)):
            lines += [f"# HELP vllm:{name}_total Counter.", f"# TYPE vllm:{name}_total counter"]
            for e, v in enumerate(values):
                lines.append(f'vllm:{name}_total{{engine="{e}",model_name="m"}} {float(v)}')
                lines.append(f'vllm:{name}_created{{engine="{e}",model_name="m"}} 1.7e+09')
        for e in (0, 1):
            lines.append(f'vllm:spec_decode_num_draft_tokens_total{{engine="{e}",model_name="m"}} '
                         f"{float(self.drafts[e] * self.k)}")
            for pos, v in enumerate(self.per_pos[e]):
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="m",'
                             f'position="{pos}"}} {float(v)}')
        return "\n".join(lines) + "\n"
