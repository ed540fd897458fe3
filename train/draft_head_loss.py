"""The drafter's output loss over all TTT steps in one pass, without [T, Vd] fp32 logits in memory.

Per step k the loss of a counted row compares the target's distribution p with the drafter's q = softmax of its
lm_head logits z over the draft vocab (train.loss, `HeadLoss`):
  kl         soft cross-entropy -sum(p * log q) (forward KL up to p's entropy);
  lk_alpha   -log alpha, alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), the chance one greedy-verified draft
             token is accepted (at a one-hot p it is the cross-entropy; its gradient, grad(TV) / alpha, does not
             vanish from a cold start as TV's alone does);
  lk_lambda  lam * CE + (1 - lam) * (1 - alpha), lam = scale * exp(-decay * alpha) with alpha detached: KL's
             guidance first, acceptance once alpha rises (defaults scale 1, decay 3).
"LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding", Samarin et al., arXiv 2602.23881.
alpha is over the draft vocab with the target's own probabilities there, p_v * mass (mass = the target's
probability of the draft vocab, `teacher_targets`): target mass outside it is never accepted. The cross-entropy
reads p renormalised over the draft vocab, as it always has.

Done plainly, autograd keeps each step's [n, Vd] logits, log-probs and gathered targets (K x 3 x 2 GB at 16k
tokens, 8B shape). Here the logits live one chunk of rows at a time: the forward also computes the gradient
d loss / d z (`chunk_terms`), keeps d/dx [N,H] and one d/dW [Vd,H] for all steps, and the backward only scales
them. The math is the plain path's; tests compare the two and both with finite differences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from train.loss_kind import KL, TINY, HeadLoss


class TeacherRows(NamedTuple):
    """The head loss's targets: p [R,Vd] the target's distribution renormalised over the draft vocab, top [R] the
    draft index of its argmax, mass [R] the target's probability of the draft vocab (None: 1, the full vocab)."""
    p: torch.Tensor
    top: torch.Tensor
    mass: torch.Tensor | None = None


class HeadLossSums(NamedTuple):
    """total = sum_k scales[k] * loss_sums[k]; per step k over its counted rows: loss_sums, correct (the drafter's
    argmax is the target's), alpha_sums (sum of alpha): [K], not synced."""
    total: torch.Tensor
    loss_sums: torch.Tensor
    correct: torch.Tensor
    alpha_sums: torch.Tensor


def row_losses(logp: torch.Tensor, q: torch.Tensor, pc: torch.Tensor, mass: torch.Tensor, loss: HeadLoss):
    """logp [n,Vd] the drafter's log-probs and q = their exp, pc [n,Vd] the renormalised target rows, mass [n] ->
    (loss per row [n], alpha per row [n]), differentiable through logp and q: the plain path, and the definition
    `chunk_terms` follows."""
    ce = -(pc * logp).sum(-1)
    alpha = torch.minimum(pc * mass[:, None], q).sum(-1)
    if loss.kind == "kl":
        return ce, alpha
    if loss.kind == "lk_alpha":
        return -torch.log(alpha.clamp(min=TINY)), alpha
    lam = loss.kl_scale * torch.exp(-loss.kl_decay * alpha.detach())
    return lam * ce + (1 - lam) * (1 - alpha), alpha


def soft_ce_sums(z: torch.Tensor, p: torch.Tensor, top: torch.Tensor, mass: torch.Tensor, loss: HeadLoss):
    """z [n,Vd] logits, p [n,Vd] targets, top [n] target argmax, mass [n] -> (sum of the row losses, correct,
    sum of alpha)."""
    logp = torch.log_softmax(z.float(), -1)
    rows, alpha = row_losses(logp, logp.exp(), p.float(), mass, loss)
    total = -(p * logp).sum() if loss.kind == "kl" else rows.sum()  # kl: the sum as it always was, bit for bit
    return total, (logp.argmax(-1) == top).sum(), alpha.detach().sum()


def chunk_terms(z: torch.Tensor, p: torch.Tensor, top: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor,
                mass: torch.Tensor, loss: HeadLoss = KL):
    """One chunk: z [c,Vd] logits; its targets are rows `rows` of p [R,Vd] / top [R] / mass [R]; scale [c] the
    weight of each row's loss. -> (loss per row [c], correct per row [c], alpha per row [c], d total / d z [c,Vd]
    in z's dtype). With q = softmax(z), u = [q < p * mass] (where min(p, q) is q) and A = sum(q * u):
    d CE / dz = q * sum(p) - p and d alpha / dz = q * (u - A). The reference for CUDA's kernel
    (train/head_loss_kernel.py)."""
    pc = p[rows].float()
    logp = torch.log_softmax(z.float(), -1)
    q = logp.exp()
    loss_rows, alpha = row_losses(logp, q, pc, mass[rows], loss)
    g_ce = q * pc.sum(-1, keepdim=True) - pc
    if loss.kind == "kl":
        g = g_ce
    else:
        under = q < pc * mass[rows, None]
        d_alpha = q * (under.float() - (q * under).sum(-1, keepdim=True))
        if loss.kind == "lk_alpha":
            g = -d_alpha / alpha.clamp(min=TINY)[:, None] * (alpha > TINY)[:, None]
        else:
            lam = (loss.kl_scale * torch.exp(-loss.kl_decay * alpha))[:, None]
            g = lam * g_ce - (1 - lam) * d_alpha
    g = g * scale[:, None]
    return loss_rows, logp.argmax(-1) == top[rows], alpha, g.to(z.dtype)


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


class ChunkPlan(NamedTuple):
    """How `_ChunkedHeadLoss` runs: rows per chunk, the matmul dtype, the chunk's terms (`terms_for`), the loss."""
    chunk: int
    dtype: torch.dtype
    terms: object
    loss: HeadLoss


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher: TeacherRows, rows, step_of_row, scales, plan: ChunkPlan):
        """x [N,H] normed hidden rows of all steps; weight [Vd,H]; teacher: rows R (mass given), of which row
        `rows[i]` is x[i]'s target; step_of_row [N]; scales [K]: the weight of each step's loss sum in the total. -> (total,
        loss sums [K], correct [K], alpha sums [K])."""
        k_steps, chunk = scales.numel(), plan.chunk
        w = weight.to(plan.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss_sums = torch.zeros(k_steps, dtype=torch.float32, device=x.device)
        alpha_sums = torch.zeros(k_steps, dtype=torch.float32, device=x.device)
        correct = torch.zeros(k_steps, dtype=torch.long, device=x.device)
        for s in range(0, x.shape[0], chunk):
            xc, step = x[s:s + chunk].to(plan.dtype), step_of_row[s:s + chunk]
            loss_rows, right, alpha, g = plan.terms(xc @ w.T, teacher.p, teacher.top, rows[s:s + chunk],
                                                    scales[step], teacher.mass, plan.loss)
            loss_sums.index_add_(0, step, loss_rows)
            alpha_sums.index_add_(0, step, alpha)
            correct.index_add_(0, step, right.long())
            if need_x or need_w:
                if need_x:
                    dx[s:s + chunk] = (g @ w).to(x.dtype)
                if need_w:
                    accumulate_product(dw, g.T, xc)
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return (loss_sums * scales).sum(), loss_sums, correct, alpha_sums

    @staticmethod
    def backward(ctx, g_total, g_sums, g_correct, g_alpha):
        dx, dw = ctx.saved_tensors
        gx = dx * g_total.to(dx.dtype) if dx is not None else None
        gw = (dw * g_total).to(ctx.weight_dtype) if dw is not None else None
        return gx, gw, None, None, None, None, None


def draft_head_loss(xs: list[torch.Tensor], weight: torch.Tensor, teacher: TeacherRows, rows: list[torch.Tensor],
                    scales: torch.Tensor, chunk: int, loss: HeadLoss = KL) -> HeadLossSums:
    """xs: per step k, the normed hidden rows [n_k,H] that count; rows: per step, their teacher rows (indices into
    teacher's R rows); scales [K]. chunk = rows per chunk (0: plain autograd, the reference path). Under autocast
    the matmuls run in its dtype, softmax in fp32, as the plain path's would."""
    device = weight.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else xs[0].dtype
    if teacher.mass is None:
        teacher = teacher._replace(mass=torch.ones_like(teacher.top, dtype=torch.float32))
    if chunk == 0:
        sums = [soft_ce_sums(x.to(dtype) @ weight.to(dtype).T, teacher.p[r], teacher.top[r], teacher.mass[r], loss)
                for x, r in zip(xs, rows, strict=True)]
        loss_sums, correct, alpha_sums = (torch.stack(list(v)) for v in zip(*sums, strict=True))
        return HeadLossSums((loss_sums * scales).sum(), loss_sums.detach(), correct, alpha_sums)
    step_of_row = torch.cat([torch.full((x.shape[0],), k, device=device) for k, x in enumerate(xs)])
    with torch.autocast(device.type, enabled=False):
        total, loss_sums, correct, alpha_sums = _ChunkedHeadLoss.apply(
            torch.cat([x.to(dtype) for x in xs]), weight, teacher, torch.cat(rows), step_of_row, scales,
            ChunkPlan(chunk, dtype, terms_for(device), loss))
    return HeadLossSums(total, loss_sums.detach(), correct, alpha_sums)
