"""TEST DOUBLE of an SGLang 0.5.23 extraction server (launched by scripts/launch_sglang_extract.sh):
`/generate` and `/health` on loopback, built on the hf engine and the plugin's real hooks.

For each `/generate` with return_hidden_states the double computes the prompt's hidden states with
core/hidden_capture.extract_batch and feeds them to extract.sglang_plugin.append_prefill_hidden_states
the way SGLang's scheduler does: the prefill split into >= 3 chunks (middle chunks flagged by
inflight_middle_chunks > 0 and store=False), every chunk batched together with a decode row of
another request and a row of a request that did not ask for hidden states. At start it runs a
warmup and a HEALTH_CHECK_ generation (no hidden states) through the same path; GET /health answers.
Each `*_prompts` option names prompts (token id lists) and acts once, on the first request of each: `cache_hit_prompts` answer with cached_tokens > 0 and no dump, as a real prefix-cache
hit computes no rows; `wrong_rows_prompts` prefill the rows of other tokens (a dump matched to the wrong
request); `abort_prompts` abort the request after its first chunk, as a client disconnect does (the
chunk already launched is still processed, finished, under the overlap scheduler); `deferred_prompts`
answer at once and prefill only when the next request arrives (a dump landing after the client gave
up). `plugin_loaded=False` is a server whose plugin never loaded (it answers normally and dumps
nothing); `aux_capture=False` one started without --enable-return-aux-hidden-states (no final states).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import torch

from core.target.hidden_capture import extract_batch
from extract import sglang_plugin as plugin
from tests.loopback_http import LoopbackServer, QuietHandler


@dataclass(eq=False)  # hashed and weakly referenced by identity, as sglang's Req (no __eq__/__slots__)
class Req:  # the attributes of sglang's Req that the plugin reads
    rid: str
    origin_input_ids: list
    return_hidden_states: bool = True
    output_ids: list = field(default_factory=list)
    inflight_middle_chunks: int = 0
    finished_reason: object = None

    def finished(self) -> bool:
        return self.finished_reason is not None


class Mode:  # CaptureHiddenMode
    def __init__(self, full: bool = True):
        self.full = full

    def is_full(self) -> bool:
        return self.full

    def is_last(self) -> bool:
        return not self.full


@dataclass
class LogitsOut:  # LogitsProcessorOutput: aux rows and post-norm final rows of one batch
    hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor | None


class FakeSGLangServer(LoopbackServer):
    def __init__(self, model, aux_layers: list[int], dump_dir, cache_hit_prompts=(), wrong_rows_prompts=(),
                 abort_prompts=(), deferred_prompts=(), plugin_loaded: bool = True, aux_capture: bool = True,
                 chunks: int = 3, max_pending: int = 4):
        self.model, self.aux_layers, self.chunks = model, aux_layers, chunks
        self.prompts = {option: {tuple(p) for p in prompts} for option, prompts in (
            ("cache_hit", cache_hit_prompts), ("wrong_rows", wrong_rows_prompts), ("abort", abort_prompts),
            ("deferred", deferred_prompts))}
        self.plugin_loaded, self.aux_capture = plugin_loaded, aux_capture
        self.plugin = plugin.Plugin(dump_dir, max_pending, lambda: True)
        self.scheduler = threading.Lock()  # SGLang runs one scheduler loop: batches never overlap
        self.deferred: list[Req] = []
        self.request_times: list[float] = []
        self.rids: list[str] = []
        self.health_checks = 0
        server = self

        class Handler(QuietHandler):
            def do_GET(self):
                server.health_checks += 1
                if self.path == "/health":
                    return self._send(200, {"status": "ok"})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                if self.path != "/generate":
                    return self._send(404, {"error": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                unknown = set(body.get("sampling_params", {})) - {"max_new_tokens", "temperature"}
                if unknown:  # SGLang answers 400 to unknown sampling params
                    return self._send(400, {"error": f"unknown sampling params {sorted(unknown)}"})
                return self._send(200, server.generate(body))

            def _send(self, status, obj):
                self.reply(status, json.dumps(obj).encode())

        self.serve(Handler)
        self.url = f"http://127.0.0.1:{self.port}"

    def _once(self, option: str, ids: list[int]) -> bool:
        """Whether `option` applies to this prompt (on its first request only)."""
        if tuple(ids) not in self.prompts[option]:
            return False
        self.prompts[option].discard(tuple(ids))
        return True

    def generate(self, body: dict) -> dict:
        rid, ids = body.get("rid") or f"auto-{time.monotonic_ns()}", list(body["input_ids"])
        self.request_times.append(time.monotonic())
        self.rids.append(rid)
        meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0}
        if self._once("cache_hit", ids):
            return {"text": "", "meta_info": {**meta, "cached_tokens": min(3, len(ids))}}
        if self._once("wrong_rows", ids):
            ids = ids[1:] + ids[:1]
        req = Req(rid, ids, return_hidden_states=bool(body.get("return_hidden_states")))
        with self.scheduler:
            while self.deferred:
                self._prefill(self.deferred.pop())
            if self._once("deferred", ids):
                self.deferred.append(req)
                return {"text": "", "meta_info": meta}
            self._prefill(req, abort_after_first_chunk=self._once("abort", ids))
        if req.finished():
            return {"text": "", "meta_info": {**meta, "finish_reason": {"type": "abort", "message": "Aborted"}}}
        return {"text": "", "meta_info": meta}

    def _prefill(self, req: Req, abort_after_first_chunk: bool = False) -> None:
        (_, aux, final), = extract_batch(self.model, [req.origin_input_ids], self.aux_layers)
        if not self.aux_capture:  # SGLang then stores the final states as hidden_states and keeps no last ones
            aux, final = final, None
        n = len(req.origin_input_ids)
        bounds = torch.linspace(0, n, self.chunks + 1).round().long().tolist() if n >= self.chunks else [0, n]
        for k in range(len(bounds) - 1):
            last = k == len(bounds) - 2
            req.inflight_middle_chunks = 0 if last else 1
            if abort_after_first_chunk and k == 1:  # the chunk launched before the abort lands finished
                req.finished_reason = {"type": "abort"}
            lo, hi = bounds[k], bounds[k + 1]
            decode = Req(f"decode-{k}", [1, 2, 3], output_ids=[7])  # a decode row sharing the batch
            quiet = Req(f"quiet-{k}", [4, 5], return_hidden_states=False)  # e.g. a warmup-like request
            out = LogitsOut(torch.cat([aux[lo:hi], torch.randn(1 + 2, aux.shape[1])]),
                            None if final is None else torch.cat([final[lo:hi], torch.randn(1 + 2, final.shape[1])]))
            off = 0
            for r, rows, store in ((req, hi - lo, last and not req.finished()), (decode, 1, True), (quiet, 2, True)):
                off = self._append(r, out, off, rows, store)
            assert off == out.hidden_states.shape[0]
            if req.finished():
                return

    def _append(self, req: Req, out: LogitsOut, offset: int, rows: int, store: bool) -> int:
        """What SGLang's result processor calls for each request of a batch: our hook, or without the
        plugin SGLang's own method, of which only the offset matters here (no dump either way)."""
        if not self.plugin_loaded:
            return offset + rows
        return plugin.append_prefill_hidden_states(None, req=req, logits_output=out, hidden_state_offset=offset,
                                                   capture_hidden_mode=Mode(True), extend_input_len=rows, store=store)

    def __enter__(self) -> FakeSGLangServer:
        plugin._PLUGIN = self.plugin if self.plugin_loaded else None
        super().__enter__()
        # SGLang's own traffic before and beside ours: a warmup and a health-check generation, neither
        # asking for hidden states (so neither may leave a dump)
        self.generate({"rid": "warmup", "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}})
        self.generate({"rid": "HEALTH_CHECK_0", "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
        self.request_times.clear()
        self.rids.clear()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.plugin.close()
        plugin._PLUGIN = None
