"""Training-time test (TTT): unroll the drafter K steps on its own outputs; pure functions.

Shapes: B batch, T tokens, H hidden, V target vocab, Vd draft vocab, K steps, nh/nkv heads, d head dim.

Alignment (the same one eval's decode engine uses): at step k, position t the drafter reads
token x[t+k+1] and the hidden of step k-1 (step 0: target aux[t]), sits at RoPE position t+k, and
learns the target's distribution at position t+k+1 (which predicts x[t+k+2]); the loss counts
where x[t+k+2] is an assistant token and the target's argmax lies in the draft vocab.
Attention at step k: causal over step-0 keys (positions <= t) plus the same-position keys of steps
1..k (the "diagonal"), exactly what a decode-time KV cache holds while drafting from t.
Packed rows (train.kernels.pack_length, train/packing.py) hold several documents: positions restart in each, step-0
keys, counted rows and teacher rows stay inside the query's document, so each trains as it would alone.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from core.drafters.drafter import Eagle3Drafter
from core.storage.hidden_shards import teacher_positions
from train.draft_head_loss import TeacherRows, draft_head_loss
from train.loss_kind import KL, HeadLoss
from train.ttt_attention import (
    compiled,
    dense_ttt_attention,
    flex_ttt_attention,
    merged_ttt_attention,
    padded_length,
    ttt_block_mask,
)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] zero-padded back to length T along dim 1."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@torch.no_grad()
def teacher_argmax_lse(final: torch.Tensor, lm_head: torch.Tensor, rows_per_pass: int = 1024):
    """[n,H] -> (argmax [n], logsumexp [n] fp32 of the target's full-vocab logits): the costliest matmul of
    training (49152 x H per row), so train computes it once per sample, not once per epoch, in lm_head's dtype
    (bf16 where native). The logsumexp tells how much of the target's probability the draft vocab holds
    (`teacher_targets`' mass); fp32 `rows_per_pass` rows at a time (a bf16 logsumexp is off by up to 0.1 at
    Kimi's ~16)."""
    logits = final.to(lm_head.dtype) @ lm_head.T
    lse = torch.cat([torch.logsumexp(part.float(), -1) for part in logits.split(rows_per_pass)]) if len(logits) \
        else logits.new_zeros(0, dtype=torch.float32)
    return logits.argmax(-1), lse


class Teacher(NamedTuple):
    """`teacher_targets`: p [B,T,Vd] the target's probabilities renormalised over the draft vocab, top [B,T] the
    draft index of its argmax, in_vocab [B,T] whether that argmax is in the draft vocab, mass [B,T] fp32 the
    target's probability of the draft vocab (1 where the full-vocab logsumexp is not given)."""
    p: torch.Tensor
    top: torch.Tensor
    in_vocab: torch.Tensor
    mass: torch.Tensor


@torch.no_grad()
def teacher_targets(final: torch.Tensor, loss_mask: torch.Tensor, draft_head: torch.Tensor, t2d: torch.Tensor,
                    argmax: torch.Tensor, doc_ids: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> Teacher:
    """final [B,T,H] -> `Teacher`. draft_head [Vd,H]: the target lm_head's draft-vocab rows, in the matmul dtype
    (bf16 on GPU; softmax in fp32, p stored in that dtype: bf16 halves the [B,T,Vd] tensor the head loss reads K
    times, as SpecForge keeps its target_p). argmax [B,T]: the full-vocab argmax and lse [B,T] its logsumexp
    (`teacher_argmax_lse`, precomputed once per sample). Only positions j whose next token is an assistant token
    (loss_mask[j+1]) of the same document (doc_ids [B,T] of packed rows) are ever a target, so only those rows
    are computed."""
    b, t, h = final.shape
    need = teacher_positions(loss_mask, doc_ids)  # [B,T]
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft index (where t2d)
    p = final.new_zeros(b, t, draft_head.shape[0], dtype=draft_head.dtype)
    top = torch.zeros(b, t, dtype=torch.long, device=final.device)
    in_vocab = torch.zeros(b, t, dtype=torch.bool, device=final.device)
    mass = torch.ones(b, t, dtype=torch.float32, device=final.device)
    rows = need.nonzero(as_tuple=True)  # once: each boolean index would wait for the device again
    z = final[rows].to(draft_head.dtype) @ draft_head.T
    p[rows] = torch.softmax(z, -1, dtype=torch.float32).to(p.dtype)
    if lse is not None:
        mass[rows] = torch.exp(torch.logsumexp(z.float(), -1) - lse[rows].float()).clamp(max=1)
    hit = argmax[rows]
    top[rows] = target_to_draft[hit].clamp(min=0)
    in_vocab[rows] = t2d[hit]
    return Teacher(p, top, in_vocab, mass)


def pad_to(x: torch.Tensor, t: int) -> torch.Tensor:
    """[B,T,...] zero-padded to length t along dim 1."""
    return x if x.shape[1] == t else torch.cat([x, x.new_zeros(x.shape[0], t - x.shape[1], *x.shape[2:])], 1)


class StepOptions(NamedTuple):
    """How TTTObjective computes the step (train.kernels, resolved by train/loop.py's `step_options`): each one
    the same loss and gradients. attention: dense | flex | merged (train/ttt_attention.py); loss_chunk: rows per
    chunk of the fused head loss (0: plain autograd; train/draft_head_loss.py); checkpoint: recompute each step's
    layer in the backward instead of keeping its activations; unroll: all K steps as one torch.compile graph
    (autocast's weight casts once, not K times; the K gradients of each weight summed inside it), through
    torch.compile's `compile_backend`; prune_rows (eager only: compiled graphs want static shapes): steps >= 1
    run only on the rows that they or a later step count (`ttt_step_rows`), step 0's o_proj and MLP only on the
    rows some step counts (`ttt_first_step_rows`)."""
    attention: str = "dense"
    loss_chunk: int = 0
    checkpoint: bool = False
    unroll: bool = False
    prune_rows: bool = False
    compile_backend: str = "inductor"


REFERENCE = StepOptions()  # dense attention, plain autograd head loss, eager steps: what the tests hold the rest to


class StepMask(NamedTuple):
    """What one step's attention needs besides q, k, v: the implementation, flex's block mask (None for the
    others) and packed rows' doc ids [B,T] (None: one document per row); dense reads doc_ids, flex its mask."""
    attention: str
    block_mask: object
    doc_ids: torch.Tensor | None


class Rows(NamedTuple):
    """A batch as the TTT loss reads it: aux [B,T,3H], input_ids and loss_mask [B,T]; packed rows
    (train/packing.py) add doc_ids (each token's document, -1 on padding) and positions (in its document)."""
    aux: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def ttt_step(drafter: Eagle3Drafter, hidden, token_qkv, positions, keys, values, mask: StepMask):
    """One unrolled step: -> (h2 [B,T,H], this step's k, v). token_qkv: this step's tokens' share of q, k, v
    (`Eagle3Drafter.token_qkv`); keys/values: the earlier steps'."""
    q, k, v, residual = drafter.qkv(hidden, None, positions, token_qkv)
    attn = ttt_attention(q, [*keys, k], [*values, v], mask)
    return drafter.finish(attn, residual), k, v


def ttt_attention(q, keys, values, mask: StepMask):
    """The step's attention [B,nh,T,d] through the chosen implementation (train/ttt_attention.py)."""
    if mask.attention == "flex":
        return flex_ttt_attention(q, keys, values, mask.block_mask)
    if mask.attention == "merged":
        return merged_ttt_attention(q, keys, values)
    return dense_ttt_attention(q, keys, values, mask.doc_ids)


def attention_rows(attn: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[B,nh,T,d] -> its rows at where = (bi, ti) as [1,nh,N,d], the layout `Eagle3Drafter.finish` takes."""
    return attn.transpose(1, 2)[where].transpose(0, 1)[None]


def scatter_rows(x: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], b: int, t: int) -> torch.Tensor:
    """[N,...] rows at where = (bi, ti) -> [B,T,...], zeros elsewhere (differentiable)."""
    return x.new_zeros(b, t, *x.shape[1:]).index_put(where, x)


def ttt_step_rows(drafter: Eagle3Drafter, hidden, token_qkv, positions, keys, values, mask: StepMask, where):
    """`ttt_step` on the rows where = (bi, ti) only: hidden [N,H], token_qkv [N,...] and positions [N] -> (h2
    [N,H], this step's k, v as [B,nkv,T,d], zeros outside those rows). Exact for those rows: at steps >= 1 a
    row attends to step 0's keys and to its own earlier steps' keys, never to another row of a later step.
    The linear layers, most of a step's FLOPs, run on N rows instead of B*T; the attention on the full layout."""
    q, k, v, residual = drafter.qkv(hidden[None], None, positions[None], tuple(y[None] for y in token_qkv))
    b, t = keys[0].shape[0], keys[0].shape[2]

    def full(x):  # [1,n,N,d] -> [B,n,T,d]
        return scatter_rows(x[0].transpose(0, 1), where, b, t).transpose(1, 2)

    k, v = full(k), full(v)
    attn = ttt_attention(full(q), [*keys, k], [*values, v], mask)
    return drafter.finish(attention_rows(attn, where), residual)[0], k, v


@functools.lru_cache(maxsize=64)
def _block_mask(t: int, steps: int, device: torch.device):
    return ttt_block_mask(t, steps, device)


def ttt_first_step_rows(drafter: Eagle3Drafter, hidden, token_qkv, positions, keys, values, mask: StepMask, where):
    """Step 0 with its o_proj and MLP on the rows where = (bi, ti) that some step counts: -> (h2 [B,T,H], zeros
    elsewhere; k, v of every row). Exact for those rows: the other rows (a chat sample's prompt, about half
    of it) are read only as keys and values, which every row still gets, and nothing reads their h2."""
    q, k, v, residual = drafter.qkv(hidden, None, positions, token_qkv)
    attn = ttt_attention(q, [*keys, k], [*values, v], mask)
    h2 = drafter.finish(attention_rows(attn, where), residual[where][None])[0]
    return scatter_rows(h2, where, *residual.shape[:2]), k, v


def ttt_unroll(drafter: Eagle3Drafter, aux, input_ids, positions, masks: tuple[StepMask, ...], checkpoint: bool,
               active: tuple | None = None) -> list[torch.Tensor]:
    """The K = len(masks) steps, each on the previous one's output -> each step's norm(h2) [B,T,H], the lm_head's input:
    normed inside the unroll, so a compiled unroll fuses the norm (forward and backward) into its own kernels
    instead of running it eagerly on the gathered rows. active: None, or per step k the rows (bi, ti)
    that step k or a later one counts: steps >= 1 run on those rows only (zeros elsewhere in their h2),
    `ttt_step_rows`; step 0 still gives every row's keys and values, `ttt_first_step_rows`."""
    hidden, keys, values, hiddens = aux, [], [], []
    (b, t), steps = input_ids.shape, len(masks)
    # step k reads token x[t+k+1] at row t (shift_left(input_ids, k + 1)): one projection of x[1:] padded by
    # K zeros serves every step as rows k..k+T of it
    all_steps = drafter.token_qkv(F.pad(input_ids[:, 1:], (0, steps)))
    for k in range(steps):
        token_qkv, pos = tuple(y[:, k:k + t] for y in all_steps), positions + k
        rows = () if active is None else (active[k],)
        gathered = bool(rows) and k > 0  # steps >= 1 take only those rows in; step 0 takes every row
        if gathered:
            hidden, token_qkv, pos = hidden[rows[0]], tuple(y[rows[0]] for y in token_qkv), pos[rows[0]]
        # tuples: a checkpoint's recompute must see the keys as they were, not the grown list
        args = (drafter, hidden, token_qkv, pos, tuple(keys), tuple(values), masks[k], *rows)
        fn = (ttt_step_rows if k else ttt_first_step_rows) if rows else ttt_step
        if checkpoint:
            hidden, kk, vv = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        else:
            hidden, kk, vv = fn(*args)
        if gathered:
            hidden = scatter_rows(hidden, rows[0], b, t)
        keys.append(kk)
        values.append(vv)
        normed = drafter.norm(hidden)
        hiddens.append(normed)
        hidden = drafter.next_input(hidden, normed)
    return hiddens


def counted(loss_mask: torch.Tensor, in_vocab: torch.Tensor, doc_ids: torch.Tensor | None, k: int) -> torch.Tensor:
    """[B,T] -> bool [B,T]: the rows step k learns from: x[t+k+2] is trained on, the target's argmax at t+k+1
    is in the draft vocab, and (packed rows) t+k+2 is in t's document, so nothing reads the next document."""
    m = shift_left(loss_mask, k + 2).bool() & shift_left(in_vocab, k + 1)
    return m if doc_ids is None else m & (shift_left(doc_ids, k + 2) == doc_ids)


def later_rows(masks: list[torch.Tensor]) -> tuple:
    """Per-step counted masks [B,T] -> per step k the rows (bi, ti) that step k or a later one counts."""
    rows, union = [None] * len(masks), torch.zeros_like(masks[0])
    for k in range(len(masks) - 1, -1, -1):
        union = union | masks[k]
        rows[k] = union.nonzero(as_tuple=True)
    return tuple(rows)


def ttt_loss(drafter: Eagle3Drafter, rows: Rows, teacher: Teacher, steps: int, decay: float,
             options: StepOptions = REFERENCE, loss: HeadLoss = KL):
    """-> (weighted loss, per-step sums {"loss_sum", "correct", "alpha_sum", "count"}: [K] tensors, detached, not
    synced). Sums, not ratios, so ranks and micro-batches combine exactly (`step_metrics`). teacher:
    `teacher_targets`'; options: `StepOptions`; loss: train.loss (train/draft_head_loss.py)."""
    p, top, in_vocab, mass = teacher
    b, t = rows.input_ids.shape
    attention = options.attention
    # flex: whole blocks; merged: whole blocks too, so a compiled step meets at most max_len / 128 lengths
    tp = padded_length(t) if attention in ("flex", "merged") else t  # padded rows count nowhere (loss mask 0)
    aux, input_ids, loss_mask, in_vocab = (pad_to(x, tp) for x in (rows.aux, rows.input_ids, rows.loss_mask, in_vocab))
    positions = (torch.arange(tp, device=aux.device)[None].expand(b, tp) if rows.positions is None
                 else pad_to(rows.positions, tp))
    doc_ids = rows.doc_ids
    if doc_ids is not None:
        if attention == "merged":
            raise ValueError("merged TTT attention takes one document per row, not packed rows")
        doc_ids = F.pad(doc_ids, (0, tp - t), value=-1)  # flex's block padding: one more run of padding
    masks = [counted(loss_mask, in_vocab, doc_ids, k) for k in range(steps)]  # [B,T]
    block_masks = [None] * steps
    if attention == "flex":  # without documents the masks depend on the length only: built once per length
        block_masks = [ttt_block_mask(tp, k + 1, aux.device, doc_ids) if doc_ids is not None else
                       _block_mask(tp, k + 1, aux.device) for k in range(steps)]
    step_masks = tuple(StepMask(attention, m, doc_ids) for m in block_masks)
    if options.unroll:
        compiled_unroll = compiled(ttt_unroll, backend=options.compile_backend)
        hiddens = compiled_unroll(drafter, aux, input_ids, positions, step_masks, options.checkpoint)
    else:
        active = later_rows(masks) if options.prune_rows else None
        hiddens = ttt_unroll(drafter, aux, input_ids, positions, step_masks, options.checkpoint, active)
    # the rows that count, once the unroll is queued: nonzero waits for the device, which now has work meanwhile
    where = [m.nonzero(as_tuple=True) for m in masks]
    xs, teacher_rows = [], []
    for k, normed in enumerate(hiddens):
        bi, ti = where[k]
        xs.append(normed[bi, ti])  # [n_k,H]: the rows that count
        teacher_rows.append(bi * t + ti + k + 1)  # their teacher: the target's distribution at t+k+1
    counts = torch.stack([m.sum() for m in masks])
    scales = decay ** torch.arange(steps, device=aux.device) / counts.clamp(min=1)
    out = draft_head_loss(xs, drafter.lm_head.weight, TeacherRows(p.flatten(0, 1), top.flatten(), mass.flatten()),
                          teacher_rows, scales, options.loss_chunk, loss)
    return out.total, {"loss_sum": out.loss_sums, "correct": out.correct.float(), "alpha_sum": out.alpha_sums,
                       "count": counts.float()}


def step_metrics(sums: dict[str, torch.Tensor], decay: float) -> dict[str, float]:
    """Per-step sums (over micro-batches and ranks) -> {"loss", "loss_k", "acc_k", "alpha_k", "tau_alpha"}: ratios
    of sums, so a rank or batch with few counted rows weighs what its rows weigh. alpha_k: the mean chance that step
    k's greedy-verified draft is accepted (train/draft_head_loss.py); tau_alpha = 1 + sum_k prod_{j<=k} alpha_j,
    the τ those rates imply, what the LK losses optimise, beside the τ probe."""
    n = sums["count"].clamp(min=1)
    loss_k, acc_k, alpha_k = ((sums[name] / n).tolist() for name in ("loss_sum", "correct", "alpha_sum"))
    row = {"loss": sum(decay ** k * lk for k, lk in enumerate(loss_k))}
    row.update({f"loss_{k}": v for k, v in enumerate(loss_k)})
    row.update({f"acc_{k}": v for k, v in enumerate(acc_k)})
    row.update({f"alpha_{k}": v for k, v in enumerate(alpha_k)})
    row["tau_alpha"] = 1 + sum(math.prod(alpha_k[:k + 1]) for k in range(len(alpha_k)))
    return row


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT unroll as one forward, so DDP / DeepSpeed wrap the whole step."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, options: StepOptions = REFERENCE,
                 loss: HeadLoss = KL):
        super().__init__()
        self.drafter, self.steps, self.decay, self.options, self.loss = drafter, steps, decay, options, loss

    def forward(self, aux, input_ids, loss_mask, teacher, doc_ids=None, positions=None, generator=None):
        """`generator`: the batch's random stream, which the TTT step draws nothing from (DFlash's draws anchors)."""
        return ttt_loss(self.drafter, Rows(aux, input_ids, loss_mask, doc_ids, positions), teacher, self.steps,
                        self.decay, self.options, self.loss)
