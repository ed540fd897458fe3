#!/usr/bin/env python3
"""Few-row fp32 products on a CPU: F.linear against core/engine/cpu_linear.py's split, as a share of the copy bound.

    python bench/bench_cpu_linear.py [--rows 1,6,16,32,128] [--threads 2]

Each shape (SmolLM2's layers, its 49k-row lm_head, the demo drafter's head and fc) is timed over 30 distinct
weights in turn (3 for the lm_head), so the weights stream from memory as in a decode step, not from cache.
Printed per shape and row count: F.linear's time and weight GB/s as a share of a large copy's rate (the
bandwidth bound a batch-1 decode can reach), and the split's speedup over it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import copy_bandwidth  # noqa: E402
from core.engine.cpu_linear import split_linear  # noqa: E402

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536),
          "lm_head": (49152, 576), "draft head": (4096, 576), "fc": (576, 1728)}


def per_weight_seconds(fn, weights: list[torch.Tensor], repeats: int = 3) -> float:
    """Best of `repeats` passes over every weight, per weight (one warm-up pass first)."""
    for w in weights:
        fn(w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - t) / len(weights))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,6,16,32,128")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bound = copy_bandwidth(torch.device("cpu")) / 2  # bytes read per second (a copy reads and writes)
    print(f"threads {args.threads}, copy bound {bound / 1e9:.1f} GB/s read")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k) for _ in range(3 if n > 10000 else 30)]
            x = torch.randn(rows, k)
            plain = per_weight_seconds(lambda w, x=x: F.linear(x, w), weights)
            split = per_weight_seconds(lambda w, x=x: split_linear(x, w, None), weights)
            rate = n * k * 4 / plain
            print(f"rows {rows:4d} {name:10s} F.linear {plain * 1e6:9.1f} us, {rate / 1e9:5.1f} GB/s = "
                  f"{rate / bound:6.1%} of the bound; split {plain / split:4.2f}x", flush=True)


if __name__ == "__main__":
    main()
