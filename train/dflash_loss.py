"""DFlash's training objective (core/dflash.py), on the same batches and teacher as EAGLE-3's TTT.

Per sample, up to `anchors` anchor positions a are drawn (from the batch's own random stream) among those whose next
token is trained on. Each anchor's block is [x_a, mask x (B-1)] at positions a .. a+B-1; its rows see the context
features of the positions before a and every row of their own block, exactly the rows an engine feeds the draft
when x_a is the last accepted token. Slot j (1..B-1) predicts the token at a+j: its teacher is the target's
distribution at position a+j-1 (`teacher_targets`' row, the full vocabulary: DFlash reads the target's own LM
head), counted where that token is trained on. The loss is soft cross-entropy against it, slot j weighted by
decay^(j-1) (train.loss_decay; DFlash's exp(-(j-1)/gamma) with gamma = -1/ln(decay)), and the metrics are the
TTT's per-step sums, one step per slot, so logs, curves and W&B read them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.dflash import DFlashDrafter


def draw_anchors(loss_mask: torch.Tensor, anchors: int, generator: torch.Generator) -> torch.Tensor:
    """loss_mask [T] of one sample -> up to `anchors` sorted positions a >= 1 whose next token is trained on."""
    t = loss_mask.shape[0]
    valid = torch.zeros(t, dtype=torch.bool, device=loss_mask.device)
    valid[1: t - 1] = loss_mask[2:].bool()
    idx = valid.nonzero().flatten()
    pick = torch.randperm(idx.numel(), generator=generator, device="cpu")[:anchors].to(idx.device)
    return idx[pick].sort().values


def block_mask(anchors: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """[A·B, C + A·B] True where visible: block i's rows see context positions < anchors[i] and all of block i."""
    q = anchors.numel() * block
    owner = torch.arange(q, device=anchors.device) // block
    ctx = torch.arange(context, device=anchors.device)[None] < anchors[owner][:, None]
    own = owner[:, None] == owner[None]
    return torch.cat([ctx, own], 1)


class DFlashObjective(torch.nn.Module):
    """The DFlash drafter plus its block loss as one forward (DDP wraps the whole step), called like TTTObjective."""

    def __init__(self, drafter: DFlashDrafter, decay: float, anchors: int, seed: int):
        super().__init__()
        self.drafter, self.decay, self.anchors, self.seed = drafter, decay, anchors, seed

    def forward(self, aux, input_ids, loss_mask, teacher, doc_ids=None, positions=None, generator=None):
        """`generator`: the batch's random stream (train/position.py's batch_generator: the same anchors for a batch
        in whichever launch trains it, so a resumed run trains what the uninterrupted one does)."""
        if doc_ids is not None:
            raise ValueError("DFlash trains on right-padded rows (train.kernels.pack_length = 0)")
        d, block = self.drafter, self.drafter.config.block_size
        p, top, _ = teacher
        steps = block - 1
        sums = {k: aux.new_zeros(steps, dtype=torch.float32) for k in ("loss_sum", "correct", "count")}
        weights = self.decay ** torch.arange(steps, device=aux.device, dtype=torch.float32)
        generator = generator if generator is not None else torch.Generator().manual_seed(self.seed)
        total = aux.new_zeros((), dtype=torch.float32)
        for b in range(aux.shape[0]):
            t = input_ids.shape[1]  # padding: loss mask 0, never an anchor or a counted slot, after every anchor
            a = draw_anchors(loss_mask[b, :t], self.anchors, generator)
            if a.numel() == 0:
                continue
            slots = a[:, None] + torch.arange(block, device=a.device)  # [A,B] positions of the block rows
            inside = slots < t
            tokens = torch.full_like(slots, d.config.mask_token_id)
            tokens[:, 0] = input_ids[b, a]
            ctx = d.context(aux[b: b + 1])
            ctx_kv = d.context_kv(ctx, torch.arange(t, device=aux.device)[None])
            mask = block_mask(a, t, block)[None, None]
            logits = d.block_logits(tokens.flatten()[None], slots.flatten()[None], ctx_kv, mask)[0]
            logits = logits.view(a.numel(), block, -1)[:, 1:]  # slot j >= 1 predicts the token at a + j
            rows = (slots[:, 1:] - 1).clamp(max=t - 1)  # its teacher: the target at position a + j - 1
            counted = inside[:, 1:] & loss_mask[b, slots[:, 1:].clamp(max=t - 1)].bool()
            log_q = F.log_softmax(logits.float(), -1)
            ce = -(p[b, rows].float() * log_q).sum(-1)  # [A, B-1]
            hit = (log_q.argmax(-1) == top[b, rows]).float()  # fp32: CPU argmax over bf16 is ~10x slower
            w = counted.float()
            sums["loss_sum"] += (ce * w).sum(0).detach()
            sums["correct"] += (hit * w).sum(0)
            sums["count"] += w.sum(0)
            total = total + (ce * w * weights).sum()
        norm = (sums["count"] * weights).sum().clamp(min=1)
        return total / norm, sums
