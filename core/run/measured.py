"""Figures measured on real machines: the plan's only source of times and of measured memory. Each has its
command and hardware in docs/PERFORMANCE.md; a shape not here prints "not measured" (core/run/plan.py).

Training time depends on the samples' lengths (a step's attention grows with them), so a drafter's speed is a
table over sequence length, and the job's hours are summed over a length distribution: the user's data where it
is known, else the one stated here for thinking answers.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from statistics import NormalDist

_PERF = "docs/PERFORMANCE.md"
# (stage, hidden, layers, storage or precision) -> [(tokens/s, where measured)]: one figure per shape.
STAGE_SPEED = {
    ("extract", 4096, 32, "bf16"): [(17_553, f"one H200, hf engine, Llama-3.1-8B shape; {_PERF}")],
    ("extract", 4096, 32, "fp8_e4m3"): [(25_230, f"one H200, hf engine, Llama-3.1-8B shape; {_PERF}")],
    ("extract", 576, 30, "bf16"): [(126_513, f"one H200, hf engine; {_PERF}"),
                                   (600, f"2-core CPU, whole stage; {_PERF}")],
    ("extract", 576, 30, "fp8_e4m3"): [(173_496, f"one H200, hf engine; {_PERF}")],
    ("train", 4096, 32, "bf16"): [(28_455, f"one H200, step only (no optimizer), 8B drafter, 8192-token batches, "
                                           f"K=7, the K-step unroll, bench_train_step; {_PERF}")],
    ("train", 576, 30, "bf16"): [(1_400, f"2-core CPU with native bf16, K=3, 16 x 298 tokens; {_PERF}")],
    ("train", 576, 30, "fp32"): [(700, f"2-core CPU, fp32, K=3, 16 x 298 tokens; {_PERF}")],
}


@dataclass(frozen=True)
class Lengths:
    """Sample lengths in tokens: lognormal (median, sigma), cut to [low, high]."""
    median: float
    sigma: float
    low: int
    high: int
    what: str

    def quantiles(self, n: int = 1000) -> list[int]:
        """n equally likely lengths (the midpoints of n equal-probability bins): a deterministic sample."""
        z = NormalDist()
        return [min(self.high, max(self.low, round(self.median * math.exp(self.sigma * z.inv_cdf((i + 0.5) / n)))))
                for i in range(n)]

    def mean(self) -> float:
        q = self.quantiles()
        return sum(q) / len(q)


# Kimi-K2.5's thinking answers: the hand-patched run held 17.3M tokens in 10,000 samples (a mean of 1,730, which a
# lognormal of median 1,050 and sigma 1.0 has), with a long tail up to what data_gen lets through.
THINKING = Lengths(median=1050, sigma=1.0, low=256, high=16384,
                   what="thinking answers: lognormal, median 1,050, sigma 1.0 (the hand-patched Kimi-K2.5 run's mean "
                        "of 1,730), cut to [256, 16,384]")
# data-parallel efficiency assumed for several GPUs of one node (DDP's all-reduce of the drafter's gradients overlaps
# the backward); not measured: no multi-GPU machine has run this project's training yet
DP_EFFICIENCY = 0.9


@dataclass(frozen=True)
class TrainSpeed:
    """One GPU training a drafter shape: tokens/s and peak memory by sequence length (batch 1, K=7)."""
    tokens_per_s: dict[int, float]
    peak_gib: dict[int, float]
    where: str

    def rate(self, length: int) -> float:
        """tokens/s at `length`: linear between measured lengths, the nearest measured one outside them."""
        xs = sorted(self.tokens_per_s)
        if length <= xs[0] or length >= xs[-1]:
            return self.tokens_per_s[xs[0] if length <= xs[0] else xs[-1]]
        i = bisect_left(xs, length)
        a, b = xs[i - 1], xs[i]
        return self.tokens_per_s[a] + (self.tokens_per_s[b] - self.tokens_per_s[a]) * (length - a) / (b - a)

    def seconds(self, lengths: list[int]) -> float:
        """One GPU's seconds for one sample of each length."""
        return sum(t / self.rate(t) for t in lengths)


# (hidden, layers, train.draft_attention) -> the drafter train builds for that target, measured
TRAIN_SPEED = {
    (7168, 61, "gqa"): TrainSpeed({2048: 11_039, 4096: 12_717, 16384: 12_924},
                                  {2048: 31.5, 4096: 37.2, 16384: 69.7},
                                  f"one H100 80GB, whole steps with AdamW (bench/bench_train_step.py); {_PERF}"),
    (7168, 61, "mla"): TrainSpeed({2048: 13_051, 4096: 13_185, 16384: 9_326},
                                  {2048: 23.2, 4096: 30.4, 16384: 72.4},
                                  f"one H100 80GB, whole steps with AdamW (bench/bench_train_step.py); {_PERF}"),
}
