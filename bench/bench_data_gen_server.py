"""Benchmark data_gen's `openai` backend: requests/s and generated tokens/s at concurrency 1, 4, 16,
each as a ratio to the single-stream rate, through the real data_gen code path (client, retries,
tokenization, parquet parts).

    python bench/bench_data_gen_server.py                      # llama.cpp serving the embedded GGUF
    python bench/bench_data_gen_server.py --base-url http://127.0.0.1:30000/v1 --samples 256   # any server
    python bench/bench_data_gen_server.py --fake-latency 0.2    # client ceiling: a scripted server (test
                                                                  # double) answering every request in 0.2 s

The ratio's ceiling is the server's: one that batches requests (SGLang, vLLM) scales with concurrency,
llama-server batches its `-np` slots (here one per request in flight) on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.run.config import load_config  # noqa: E402
from data_gen.generate import main as data_gen_main  # noqa: E402
from eval.llamacpp_server import embedded_target_server, server_threads  # noqa: E402


def run_once(base_url: str, concurrency: int, samples: int, max_new_tokens: int, out: Path) -> dict:
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [
        f"run_dir={out}", "data_gen.backend=openai", f"data_gen.base_url={base_url}",
        f"data_gen.num_samples={samples}", f"data_gen.max_new_tokens={max_new_tokens}",
        f"data_gen.concurrency={concurrency}", "data_gen.max_prompt_tokens=128"])
    data_gen_main(cfg)
    s = json.loads((out / "conversations/summary.json").read_text())
    return {"requests_per_s": s["assistant_turns_now"] / s["wall_s"], "tokens_per_s": s["loss_tokens_now"] / s["wall_s"],
            "wall_s": s["wall_s"], "requests": s["assistant_turns_now"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="", help="an already running server (default: start llama.cpp)")
    ap.add_argument("--samples", type=int, default=32, help="conversations per concurrency level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--fake-latency", type=float, default=None,
                    help="use tests/fake_openai_server.py answering each request after this many seconds: "
                         "an ideal batching server, so the ratio shows how the client itself scales")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.fake_latency is not None:
        from tests.fake_openai_server import FakeOpenAIServer
        fake = FakeOpenAIServer(latency=args.fake_latency)
        server = contextlib.nullcontext(fake.__enter__().url)
        args.base_url = f"scripted test double, {args.fake_latency} s per request"
    else:
        server = contextlib.nullcontext(args.base_url) if args.base_url else embedded_target_server(parallel=max(levels))
    with server as url, tempfile.TemporaryDirectory() as tmp:
        results = {c: run_once(url, c, args.samples, args.max_new_tokens, Path(tmp) / f"c{c}") for c in levels}
    base = results[levels[0]]
    local = f"llama-server b11434 (SmolLM2-135M Q4_1 GGUF, {server_threads()} threads, one slot per request in flight)"
    print(f"server {args.base_url or local}; "
          f"{args.samples} ShareGPT prompts x <= {args.max_new_tokens} new tokens per level")
    for c, r in results.items():
        print(f"concurrency {c:>3}: {r['requests_per_s']:6.2f} req/s  {r['tokens_per_s']:7.1f} tok/s  "
              f"= {r['requests_per_s'] / base['requests_per_s']:.2f}x req/s, "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x tok/s of concurrency {levels[0]}  "
              f"({r['requests']} requests in {r['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
