"""fp8 (e4m3) storage of hidden-state rows with one fp32 scale per token and group (pure functions).

A row [g*h] is cut into g groups (the 3 aux layers, or the 1 final state) because the layers' scales
differ by orders of magnitude; each group is scaled so its largest |value| maps to e4m3's max (448).
Bytes per token: g*h + 4*g instead of 2*g*h for bf16. e4m3 keeps 3 mantissa bits, so each value is
within ~6% of itself (plus flush-to-zero below 2^-9 of the group's max).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, g*h] -> (q [n, g*h] e4m3, scale [n, g] fp32) with x ~= q * scale per group."""
    n = x.shape[0]
    xg = x.float().reshape(n, groups, -1)
    scale = xg.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero groups stay exactly zero
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, -1), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [n, g*h] e4m3, scale [n, g]) -> [n, g*h] fp32."""
    n, g = scale.shape
    return (q.float().reshape(n, g, -1) * scale.float()[..., None]).reshape(n, -1)
