"""The same prompts, as token ids, to a base server and a speculative server at each concurrency level:
latency, time to first token, tokens/s, and τ from the speculative engine's own counters.

    python -m eval --engine server --server-type llamacpp|vllm|sglang --base URL --spec URL [--concurrency 1,4]

llama.cpp and vLLM are asked over the OpenAI-compatible `/v1/completions` (streamed, `prompt` = token
ids) and counted from their Prometheus /metrics; SGLang over its native `/generate` (streamed,
`input_ids`), counted from each request's `meta_info`. Greedy (T=0) throughout, so the speculative
outputs must equal the base outputs; a mismatch is reported per level, not hidden. The two servers take
turns (`taking_turns`), so the speedup compares them over the same minutes.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from eval.spec_counters import (
    PROMETHEUS_PREFIX,
    counter_window,
    per_request_tau,
    prometheus_spec_counters,
    sglang_window,
)

log = logging.getLogger("eval")
SERVER_TYPES = ("llamacpp", "vllm", "sglang")


def _sse(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _openai_body(url: str, ids: list[int], n: int, server_type: str) -> tuple[str, dict]:
    body = {"prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if server_type == "llamacpp":
        body.update(top_k=1, cache_prompt=False)  # each level re-sends the prompts: no prefix-cache TTFT
    return f"{url}/v1/completions", body


def request(url: str, ids: list[int], n: int, server_type: str, timeout: float = 600.0) -> dict:
    """One streamed greedy completion -> {"text", "output_tokens", "ttft_s", "latency_s", and the engine's
    own per-request record: "meta_info" (SGLang), "timings" (llama.cpp) or "metrics" (vLLM, when started with
    --per-request-spec-decode-metrics summary)}."""
    if server_type == "sglang":
        endpoint, body = f"{url}/generate", {"input_ids": ids, "stream": True,
                                             "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}
    else:
        endpoint, body = _openai_body(url, ids, n, server_type)
    t0 = time.perf_counter()
    ttft, text, usage, meta, timings, per_request = None, "", None, None, None, None
    with httpx.stream("POST", endpoint, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{endpoint}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for chunk in _sse(r):
            if "error" in chunk:
                raise RuntimeError(f"{endpoint}: {chunk['error']}")
            if server_type == "sglang":  # cumulative text; meta_info of the last chunk is final
                piece, text, meta = chunk.get("text", ""), chunk.get("text", ""), chunk.get("meta_info", meta)
            else:
                piece = "".join(c.get("text", "") for c in chunk.get("choices", []))
                text += piece
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings  # llama.cpp: incl. draft_n, draft_n_accepted
                per_request = chunk.get("metrics") or per_request  # vLLM, last chunk: metrics.speculative_decoding
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    tokens = meta["completion_tokens"] if meta else (usage or {}).get("completion_tokens")
    if tokens is None:
        raise RuntimeError(f"{endpoint}: the stream carried no token count (usage / meta_info)")
    return {"text": text, "output_tokens": tokens, "ttft_s": ttft if ttft is not None else latency,
            "latency_s": latency, "meta_info": meta, "timings": timings, "metrics": per_request}


def run_level(url: str, items: list[tuple[str, list[int]]], n: int, concurrency: int, server_type: str) -> dict:
    """All prompts with `concurrency` requests in flight -> {"rows": per-request rows, "wall_s"}."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda item: {"id": item[0], **request(url, item[1], n, server_type)}, items))
    return {"rows": rows, "wall_s": time.perf_counter() - t0}


def level_summary(rows: list[dict], wall: float) -> dict:
    """A level's rows and the wall time they took -> the rows plus the level's throughput and latencies."""
    tokens = sum(r["output_tokens"] for r in rows)
    decode = [r["output_tokens"] / (r["latency_s"] - r["ttft_s"]) for r in rows
              if r["output_tokens"] > 1 and r["latency_s"] > r["ttft_s"]]
    return {"rows": rows, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "mean_latency_s": sum(r["latency_s"] for r in rows) / len(rows),
            "mean_ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
            "mean_request_tokens_per_s": sum(decode) / len(decode) if decode else None}


def taking_turns(urls: dict[str, str], items: list[tuple[str, list[int]]], n: int, concurrency: int,
                 server_type: str) -> dict[str, dict]:
    """Each server answers every prompt at `concurrency` in flight, the servers taking turns block by block
    (`concurrency` prompts a block, who goes first swapped each block), so a shared machine whose speed drifts
    between minutes (±15% measured on the 2-core CPUs here) weighs on both alike -> per server its summary."""
    rows, wall = {name: [] for name in urls}, dict.fromkeys(urls, 0.0)
    for b, i in enumerate(range(0, len(items), concurrency)):
        for name in list(urls)[::1 if b % 2 == 0 else -1]:
            level = run_level(urls[name], items[i:i + concurrency], n, concurrency, server_type)
            rows[name] += level["rows"]
            wall[name] += level["wall_s"]
    return {name: level_summary(rows[name], wall[name]) for name in urls}


def metrics(url: str, server_type: str) -> dict | None:
    """The speculative engine's running Prometheus counters (llama.cpp, vLLM); None for SGLang, which counts
    per request in meta_info instead."""
    if server_type == "sglang":
        return None
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    return prometheus_spec_counters(r.text, PROMETHEUS_PREFIX[server_type])


def spec_window_counts(url: str, server_type: str, before: dict | None, rows: list[dict]) -> dict:
    """τ and acceptance over one level of the speculative server: its requests' meta_info (SGLang) or its
    counters since `before` (llama.cpp, vLLM)."""
    if server_type == "sglang":
        return sglang_window([r["meta_info"] for r in rows])
    return counter_window(before, metrics(url, server_type))


def paired_level(c: int, base: dict, spec: dict, counted: dict, server_type: str) -> dict:
    """One concurrency level of the report from both servers' level summaries and the speculative counts."""
    same = sum(b["text"] == s["text"] for b, s in zip(base["rows"], spec["rows"], strict=True))
    level = {"concurrency": c, "base": base, "spec": spec, **counted,
             "per_request_acceptance_length": per_request_tau(spec["rows"], server_type),
             "speedup": spec["tokens_per_s"] / base["tokens_per_s"], "outputs_equal": same}
    log.info("concurrency %d: base %.1f tok/s, spec %.1f tok/s (%.2fx), τ %.3f, outputs equal %d/%d", c,
             base["tokens_per_s"], spec["tokens_per_s"], level["speedup"], level["acceptance_length"], same,
             len(base["rows"]))
    return level


def compare_servers(base_url: str, spec_url: str, items: list[tuple[str, list[int]]], n: int,
                    levels: list[int], server_type: str) -> dict:
    """Base vs speculative at each concurrency level -> the server part of the eval report."""
    for url in (base_url, spec_url):  # warm-up, outside every window
        request(url, items[0][1], 8, server_type)
    out = []
    for c in levels:
        before = metrics(spec_url, server_type)
        done = taking_turns({"base": base_url, "spec": spec_url}, items, n, c, server_type)
        out.append(paired_level(c, done["base"], done["spec"],
                                spec_window_counts(spec_url, server_type, before, done["spec"]["rows"]), server_type))
    return {"server_type": server_type, "base_url": base_url, "spec_url": spec_url, "levels": out,
            "num_prompts": len(items), "max_new_tokens": n}
