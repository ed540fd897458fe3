"""The drafter's output loss over all TTT steps in one pass, without [T, Vd] fp32 logits in memory.

Per step k the loss is the soft cross-entropy between the target's draft-vocab distribution p and the
drafter's log-softmax over its lm_head logits, summed over counted rows. Done plainly, autograd keeps
each step's [n, Vd] logits, log-probs and gathered targets (K x 3 x 2 GB at 16k tokens, 8B shape).
Here the logits live one chunk of rows at a time: the forward also computes the gradient
(d loss / d z = softmax(z) * sum(p) - p), keeps d/dx [N,H] and one d/dW [Vd,H] for all steps, and
the backward only scales them. The math is the plain path's; tests compare the two.
"""

from __future__ import annotations

import torch


def soft_ce_sums(z: torch.Tensor, p: torch.Tensor, top: torch.Tensor):
    """z [n,Vd] logits, p [n,Vd] targets, top [n] target argmax -> (sum of -p.log_softmax(z), correct)."""
    logp = torch.log_softmax(z.float(), -1)
    return -(p * logp).sum(), (logp.argmax(-1) == top).sum()


def chunk_terms(z: torch.Tensor, p: torch.Tensor, top: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor):
    """One chunk: z [c,Vd] logits; its targets are rows `rows` of p [R,Vd] / top [R]; scale [c] the
    weight of each row's loss. -> (loss per row [c], correct per row [c], d total / d z [c,Vd] in z's dtype).
    The reference for CUDA's one-kernel copy (train/head_loss_kernel.py)."""
    pc = p[rows].float()
    logp = torch.log_softmax(z.float(), -1)
    g = (logp.exp() * pc.sum(-1, keepdim=True) - pc) * scale[:, None]
    return -(pc * logp).sum(-1), logp.argmax(-1) == top[rows], g.to(z.dtype)


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b maybe bf16: on CUDA in the GEMM's epilogue (no [Vd,H] bf16 product,
    fp32 copy and add: ~1.5 GB of traffic per chunk at the 8B shape), elsewhere through an fp32 product."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def terms_for(device: torch.device):
    """The chunk's elementwise terms: on CUDA one Triton kernel (train/head_loss_kernel.py: 0.4-0.5 of
    torch.compile's time at the 8B shape), elsewhere `chunk_terms` as it reads."""
    if device.type != "cuda":
        return chunk_terms
    from train.head_loss_kernel import fused_chunk_terms

    return fused_chunk_terms


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, p, top, rows, step_of_row, scales, chunk, dtype, terms):
        """x [N,H] normed hidden rows of all steps; weight [Vd,H]; p [R,Vd], top [R]: teacher rows,
        of which row `rows[i]` is x[i]'s target; step_of_row [N]; scales [K]: the weight of each
        step's loss sum in the total. -> (total, loss sums [K], correct [K])."""
        k_steps = scales.numel()
        w = weight.to(dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss_sums = torch.zeros(k_steps, dtype=torch.float32, device=x.device)
        correct = torch.zeros(k_steps, dtype=torch.long, device=x.device)
        for s in range(0, x.shape[0], chunk):
            xc, step = x[s:s + chunk].to(dtype), step_of_row[s:s + chunk]
            loss_rows, right, g = terms(xc @ w.T, p, top, rows[s:s + chunk], scales[step])
            loss_sums.index_add_(0, step, loss_rows)
            correct.index_add_(0, step, right.long())
            if need_x or need_w:
                if need_x:
                    dx[s:s + chunk] = (g @ w).to(x.dtype)
                if need_w:
                    accumulate_product(dw, g.T, xc)
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return (loss_sums * scales).sum(), loss_sums, correct

    @staticmethod
    def backward(ctx, g_total, g_sums, g_correct):
        dx, dw = ctx.saved_tensors
        gx = dx * g_total.to(dx.dtype) if dx is not None else None
        gw = (dw * g_total).to(ctx.weight_dtype) if dw is not None else None
        return gx, gw, None, None, None, None, None, None, None, None


def draft_head_loss(xs: list[torch.Tensor], weight: torch.Tensor, p: torch.Tensor, top: torch.Tensor,
                    rows: list[torch.Tensor], scales: torch.Tensor, chunk: int):
    """xs: per step k, the normed hidden rows [n_k,H] that count; rows: per step, their teacher rows
    (indices into p [R,Vd] and top [R]); scales [K]. -> (sum_k scales[k] * loss_sum_k, loss sums [K],
    correct [K]). chunk = rows per chunk (0: plain autograd, the reference path). Under autocast the
    matmuls run in its dtype, softmax in fp32, as the plain path's would."""
    device = weight.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else xs[0].dtype
    if chunk == 0:
        sums = [soft_ce_sums(x.to(dtype) @ weight.to(dtype).T, p[r], top[r]) for x, r in zip(xs, rows, strict=True)]
        loss_sums = torch.stack([s for s, _ in sums])
        return (loss_sums * scales).sum(), loss_sums.detach(), torch.stack([c for _, c in sums])
    step_of_row = torch.cat([torch.full((x.shape[0],), k, device=device) for k, x in enumerate(xs)])
    with torch.autocast(device.type, enabled=False):
        total, loss_sums, correct = _ChunkedHeadLoss.apply(torch.cat([x.to(dtype) for x in xs]), weight, p, top, torch.cat(rows),
                                                           step_of_row, scales, chunk, dtype, terms_for(device))
    return total, loss_sums.detach(), correct
