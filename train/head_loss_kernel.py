"""`chunk_terms` of train/draft_head_loss.py as one Triton kernel (CUDA): two passes over each row, three for the LK
losses.

The chunk's elementwise terms read its logits z [c,Vd] and the teacher rows p[rows] [c,Vd] and write the
gradient g [c,Vd]. torch.compile made them a 1.66 ms pass per 8192-row chunk at the 8B shape (Vd 32000),
~3x its bytes (docs/PERFORMANCE.md). Here one program owns a row: pass 1 walks z and p once for the row's
max, sum of exp, sum(p) and sum(p*z); pass 2 walks them again (a row is 128 KB: the second read mostly hits
L2) for alpha = sum(min(p * mass, q)) and A = sum(q where q < p * mass), the argmax of z - lse as torch.argmax
finds it (the first of equal values), and, for kl, writes g = (softmax(z) * sum(p) - p) * scale. The LK losses'
gradient needs alpha and A first: a third pass writes it (d alpha / dz = q * (u - A), u = [q < p * mass]).
loss: kl = sum(p) * lse - sum(p*z); lk_alpha = -log alpha; lk_lambda = lam * kl + (1 - lam) * (1 - alpha).
Softmax math in fp32, as in `chunk_terms`; tests/test_head_loss_kernel.py holds the two to 1e-5 under Triton's
interpreter on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from core.run.config import HEAD_LOSSES
from train.loss_kind import TINY, HeadLoss

BLOCK = 2048  # elements of a row per iteration: 2 x 8 KB of bf16 in flight per program


@triton.jit
def _row_stats(z_row, p_row, vd, BLOCK: tl.constexpr):
    """Pass 1 over a row: -> (logsumexp of z, sum(p), sum(p*z)), the max and sum of exp online."""
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    sp = tl.zeros((), tl.float32)
    spz = tl.zeros((), tl.float32)
    for start in range(0, vd, BLOCK):
        cols = start + offs
        inside = cols < vd
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        sp += tl.sum(p, 0)
        spz += tl.sum(p * tl.where(inside, z, 0.0), 0)
    return m + tl.log(s), sp, spz


@triton.jit
def _lk_gradient(z_row, p_row, g_row, vd, lse, sp, mass, alpha, a_under, lam, scale, tiny, LOSS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Pass 3 over a row, the LK losses only: g = -(d alpha / dz) / alpha (lk_alpha) or lam * (q * sum(p) - p)
    - (1 - lam) * d alpha / dz (lk_lambda), d alpha / dz = q * (u - A), times the row's scale."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, vd, BLOCK):
        cols = start + offs
        inside = cols < vd
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
        q = tl.exp(z - lse)
        d_alpha = q * (tl.where(q < p * mass, 1.0, 0.0) - a_under)
        if LOSS == 1:
            g = tl.where(alpha > tiny, -d_alpha / tl.maximum(alpha, tiny), 0.0)
        else:
            g = lam * (q * sp - p) - (1 - lam) * d_alpha
        tl.store(g_row + cols, (g * scale).to(g_row.dtype.element_ty), mask=inside)


@triton.jit
def _row_terms(z_ptr, p_ptr, g_ptr, rows_ptr, top_ptr, scale_ptr, mass_ptr, loss_ptr, right_ptr, alpha_ptr, vd,
               stride_z, stride_p, stride_g, kl_scale, kl_decay, tiny, LOSS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    z_row = z_ptr + i.to(tl.int64) * stride_z  # the chunk's row i
    g_row = g_ptr + i.to(tl.int64) * stride_g
    p_row = p_ptr + row.to(tl.int64) * stride_p  # its teacher row
    mass, scale = tl.load(mass_ptr + row), tl.load(scale_ptr + i)
    lse, sp, spz = _row_stats(z_row, p_row, vd, BLOCK)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.zeros((), tl.int32)
    alpha = tl.zeros((), tl.float32)
    a_under = tl.zeros((), tl.float32)
    for start in range(0, vd, BLOCK):  # pass 2: alpha, A, the argmax of log-probs; kl's gradient
        cols = start + offs
        inside = cols < vd
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
        logp = z - lse
        q = tl.exp(logp)
        under = q < p * mass
        alpha += tl.sum(tl.where(under, q, p * mass), 0)
        a_under += tl.sum(tl.where(under, q, 0.0), 0)
        if LOSS == 0:
            tl.store(g_row + cols, ((q * sp - p) * scale).to(g_ptr.dtype.element_ty), mask=inside)
        block_best = tl.max(logp, 0)
        block_at = tl.argmax(logp, 0, tie_break_left=True)
        better = block_best > best  # strictly: an earlier block keeps a tie, as torch.argmax keeps the first
        best_at = tl.where(better, start + block_at, best_at)
        best = tl.maximum(best, block_best)
    ce = sp * lse - spz
    lam = kl_scale * tl.exp(-kl_decay * alpha)
    loss = ce
    if LOSS != 0:
        _lk_gradient(z_row, p_row, g_row, vd, lse, sp, mass, alpha, a_under, lam, scale, tiny, LOSS, BLOCK)
        loss = -tl.log(tl.maximum(alpha, tiny)) if LOSS == 1 else lam * ce + (1 - lam) * (1 - alpha)
    tl.store(loss_ptr + i, loss)
    tl.store(alpha_ptr + i, alpha)
    tl.store(right_ptr + i, (best_at == tl.load(top_ptr + row)).to(tl.int8))


def fused_chunk_terms(z: torch.Tensor, p: torch.Tensor, top: torch.Tensor, rows: torch.Tensor,
                      scale: torch.Tensor, mass: torch.Tensor, loss: HeadLoss):
    """`chunk_terms(z, p, top, rows, scale, mass, loss)`: -> (loss per row [c] fp32, correct per row [c] bool,
    alpha per row [c] fp32, g [c,Vd] in z's dtype). z and p row-major in their last dim (a chunk's product and
    the teacher tensor are)."""
    c, vd = z.shape
    if z.stride(1) != 1 or p.stride(1) != 1:
        raise ValueError("fused_chunk_terms: z and p must be contiguous in their last dim")
    g = torch.empty_like(z)
    out = torch.empty(2, c, dtype=torch.float32, device=z.device)  # loss, alpha
    right = torch.empty(c, dtype=torch.int8, device=z.device)
    if c:
        _row_terms[(c,)](z, p, g, rows.contiguous(), top.contiguous(), scale.float().contiguous(),
                         mass.float().contiguous(), out[0], right, out[1], vd, z.stride(0), p.stride(0), g.stride(0),
                         float(loss.kl_scale), float(loss.kl_decay), TINY, LOSS=HEAD_LOSSES.index(loss.kind), BLOCK=BLOCK,
                         num_warps=8)
    return out[0], right.bool(), out[1], g
