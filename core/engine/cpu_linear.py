"""Linear layers of few rows on a CPU, split across torch's threads (the decode engine's batch-1 steps).

Why: on some CPUs (AVX2 without AVX-512), MKL runs a product of 1-32 rows by a weight practically on one
thread, whether torch has 1 or 2 threads, so a decode token's weights stream at a fraction of the memory
bandwidth. The same product as one batched matmul over SLICES slices of the weight's output rows (a view,
no copy) runs the slices on all threads, faster at every layer shape of 1-32 rows and on a large lm_head
(docs/PERFORMANCE.md, `make demo`). From ~128 rows on, MKL's own
threading is as fast or faster, so bigger inputs (prefill, data_gen's batched steps, training) keep
F.linear. Each output is still one dot product over the input features; only the kernel that runs it
changes, so values agree with F.linear's to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32  # above this MKL's threaded GEMM wins (docs/PERFORMANCE.md)
SLICES = 4     # 2 and 8 measure within ±15% of 4 on 2 threads


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), as SLICES batched products when x has at most MAX_ROWS rows and torch
    has more than one thread; weight [N,K] contiguous with N divisible by SLICES."""
    n, k = weight.shape
    rows = x.numel() // k
    if rows > MAX_ROWS or torch.get_num_threads() < 2:
        return F.linear(x, weight, bias)
    parts = torch.bmm(x.reshape(1, rows, k).expand(SLICES, rows, k),
                      weight.view(SLICES, n // SLICES, k).transpose(1, 2))  # [SLICES, rows, N/SLICES]
    out = parts.transpose(0, 1).reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias


class SplitLinear(nn.Linear):
    """An nn.Linear whose forward is `split_linear` (same parameters, state dict and tied weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_linear(x, self.weight, self.bias)


def split_cpu_linears(module: nn.Module) -> nn.Module:
    """Make every plain fp32 nn.Linear of a CPU module a SplitLinear, in place (others keep theirs) -> module."""
    for m in module.modules():
        w = getattr(m, "weight", None)
        if (type(m) is nn.Linear and w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()
                and w.shape[0] % SLICES == 0):
            m.__class__ = SplitLinear
    return module
