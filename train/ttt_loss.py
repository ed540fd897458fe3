"""Training-time test (TTT): unroll the drafter K steps on its own outputs; pure functions.

Shapes: B batch, T tokens, H hidden, V target vocab, Vd draft vocab, K steps, nh/nkv heads, d head dim.

Alignment (the same one eval's decode engine uses): at step k, position t the drafter reads
token x[t+k+1] and the hidden of step k-1 (step 0: target aux[t]), sits at RoPE position t+k, and
learns the target's distribution at position t+k+1 (which predicts x[t+k+2]); the loss counts
where x[t+k+2] is an assistant token and the target's argmax lies in the draft vocab.
Attention at step k: causal over step-0 keys (positions <= t) plus the same-position keys of steps
1..k (the "diagonal"), exactly what a decode-time KV cache holds while drafting from t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.drafter import Eagle3Drafter
from core.hidden_shards import teacher_positions


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] zero-padded back to length T along dim 1."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@torch.no_grad()
def teacher_argmax(final: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """[n,H] -> [n] target argmax over the full vocab: the costliest matmul of training (49152 x H per
    row), so train computes it once per sample, not once per epoch, in lm_head's dtype (bf16 where native)."""
    return (final.to(lm_head.dtype) @ lm_head.T).argmax(-1)


@torch.no_grad()
def teacher_targets(final: torch.Tensor, loss_mask: torch.Tensor, lm_head: torch.Tensor,
                    draft_ids: torch.Tensor, t2d: torch.Tensor, argmax: torch.Tensor | None = None):
    """final [B,T,H] -> (p [B,T,Vd] target probs renormalised over the draft vocab,
    top [B,T] draft index of the target argmax, in_vocab [B,T] whether that argmax is in the draft vocab).
    Only positions j whose next token is an assistant token (loss_mask[j+1]) are ever a target, so
    only those rows are computed. `argmax` [B,T]: the full-vocab argmax, precomputed (else computed here)."""
    b, t, h = final.shape
    need = teacher_positions(loss_mask)  # [B,T]
    rows = final[need].float()  # [n,H]
    arg = argmax[need] if argmax is not None else teacher_argmax(rows, lm_head)
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft index (where t2d)
    p = final.new_zeros(b, t, draft_ids.numel(), dtype=torch.float32)
    top = torch.zeros(b, t, dtype=torch.long, device=final.device)
    in_vocab = torch.zeros(b, t, dtype=torch.bool, device=final.device)
    p[need] = torch.softmax(rows @ lm_head[draft_ids].float().T, -1)
    top[need] = target_to_draft[arg].clamp(min=0)
    in_vocab[need] = t2d[arg]
    return p, top, in_vocab


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B,nh,T,d]; keys/values: step 0..k, each [B,nkv,T,d]. -> [B,nh,T,d]."""
    nh, t, d = q.shape[1], q.shape[2], q.shape[3]
    rep = nh // keys[0].shape[1]
    ks = [k.repeat_interleave(rep, 1) for k in keys]
    vs = [v.repeat_interleave(rep, 1) for v in values]
    scale = d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ ks[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B,nh,T,T]
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in ks[1:]]  # k x [B,nh,T,1]
    p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
    out = p[..., :t] @ vs[0]
    for j, v in enumerate(vs[1:]):
        out = out + p[..., t + j:t + j + 1] * v
    return out


def ttt_loss(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor], steps: int, decay: float):
    """-> (weighted loss, per-step sums {"loss_sum", "correct", "count"}: [K] tensors, detached, not
    synced). Sums, not ratios, so ranks and micro-batches combine exactly (`step_metrics`)."""
    p, top, in_vocab = teacher
    b, t = input_ids.shape
    positions = torch.arange(t, device=aux.device)[None].expand(b, t)
    hidden, keys, values = aux, [], []
    total = aux.new_zeros(())
    sums = {"loss_sum": [], "correct": [], "count": []}
    for k in range(steps):
        q, kk, vv, residual = drafter.qkv(hidden, shift_left(input_ids, k + 1), positions + k)
        keys.append(kk)
        values.append(vv)
        hidden = drafter.finish(ttt_attention(q, keys, values), residual)
        mask = shift_left(loss_mask, k + 2).bool() & shift_left(in_vocab, k + 1)  # [B,T]
        n = mask.sum()
        logp = F.log_softmax(drafter.logits(hidden[mask]).float(), -1)  # [n,Vd]: masked rows only
        loss_sum = -(shift_left(p, k + 1)[mask] * logp).sum()
        total = total + decay ** k * loss_sum / n.clamp(min=1)
        sums["loss_sum"].append(loss_sum.detach())
        sums["correct"].append((logp.argmax(-1) == shift_left(top, k + 1)[mask]).sum().detach())
        sums["count"].append(n.detach())
    return total, {name: torch.stack(v).float() for name, v in sums.items()}


def step_metrics(sums: dict[str, torch.Tensor], decay: float) -> dict[str, float]:
    """Per-step sums (over micro-batches and ranks) -> {"loss", "loss_k", "acc_k"}: ratios of sums,
    so a rank or batch with few counted rows weighs what its rows weigh."""
    n = sums["count"].clamp(min=1)
    loss_k, acc_k = (sums["loss_sum"] / n).tolist(), (sums["correct"] / n).tolist()
    row = {"loss": sum(decay ** k * lk for k, lk in enumerate(loss_k))}
    row.update({f"loss_{k}": v for k, v in enumerate(loss_k)})
    row.update({f"acc_{k}": v for k, v in enumerate(acc_k)})
    return row


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT unroll as one forward, so DDP / DeepSpeed wrap the whole step."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay

    def forward(self, aux, input_ids, loss_mask, teacher):
        return ttt_loss(self.drafter, aux, input_ids, loss_mask, teacher, self.steps, self.decay)
