"""DFlash's training objective (core/drafters/dflash.py), on the same batches and teacher as EAGLE-3's TTT.

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

from core.drafters.dflash import DFlashDrafter
from train.draft_head_loss import TeacherRows, draft_head_loss
from train.loss_kind import KL, HeadLoss


def draw_anchors(loss_mask: torch.Tensor, anchors: int, generator: torch.Generator) -> torch.Tensor:
    """loss_mask [T] of one sample -> up to `anchors` sorted positions a >= 1 whose next token is trained on."""
    t = loss_mask.shape[0]
    valid = torch.zeros(t, dtype=torch.bool, device=loss_mask.device)
    valid[1: t - 1] = loss_mask[2:].bool()
    idx = valid.nonzero().flatten()
    pick = torch.randperm(idx.numel(), generator=generator, device="cpu")[:anchors].to(idx.device)
    return idx[pick].sort().values


def block_mask(anchors: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """anchors [..., A] -> [..., A·B, C + A·B] True where visible: block i's rows see context positions < its anchor
    and all of block i."""
    q = anchors.shape[-1] * block
    owner = torch.arange(q, device=anchors.device) // block
    ctx = torch.arange(context, device=anchors.device) < anchors[..., owner, None]
    own = (owner[:, None] == owner[None]).expand(*anchors.shape[:-1], q, q)
    return torch.cat([ctx, own], -1)


class DFlashObjective(torch.nn.Module):
    """The DFlash drafter plus its block loss as one forward (DDP wraps the whole step), called like TTTObjective."""

    def __init__(self, drafter: DFlashDrafter, decay: float, anchors: int, seed: int, loss_chunk: int = 0,
                 loss: HeadLoss = KL):
        super().__init__()
        self.drafter, self.decay, self.anchors, self.seed = drafter, decay, anchors, seed
        self.loss_chunk = loss_chunk  # rows per chunk of the fused head loss (0: plain autograd)
        self.loss = loss  # train.loss, per slot as per TTT step

    def forward(self, aux, input_ids, loss_mask, teacher, doc_ids=None, positions=None, generator=None):
        """`generator`: the batch's random stream (train/position.py's batch_generator: the same anchors for a batch
        in whichever launch trains it, so a resumed run trains what the uninterrupted one does). One forward for
        the whole batch: each sample's blocks, padded to the batch's most anchors (a padded block counts nowhere)."""
        if doc_ids is not None:
            raise ValueError("DFlash trains on right-padded rows (train.kernels.pack_length = 0)")
        d, block = self.drafter, self.drafter.config.block_size
        (n, t), dev = input_ids.shape, aux.device  # padding: loss mask 0, never an anchor or a counted slot
        generator = generator if generator is not None else torch.Generator().manual_seed(self.seed)
        drawn = [draw_anchors(loss_mask[b], self.anchors, generator) for b in range(n)]
        a = torch.zeros(n, max(1, max(x.numel() for x in drawn)), dtype=torch.long, device=dev)
        real = torch.zeros_like(a, dtype=torch.bool)
        for b, x in enumerate(drawn):
            a[b, : x.numel()], real[b, : x.numel()] = x, True
        slots = a[..., None] + torch.arange(block, device=dev)  # [N,A,B] positions of the block rows
        tokens = torch.full_like(slots, d.config.mask_token_id)
        tokens[..., 0] = input_ids.gather(1, a)
        ctx_kv = d.context_kv(d.context(aux), torch.arange(t, device=dev).expand(n, t))
        hidden = d.block_hidden(tokens.flatten(1), slots.flatten(1), ctx_kv, block_mask(a, t, block)[:, None])
        hidden = hidden.view(n, a.shape[1], block, -1)[:, :, 1:]  # slot j >= 1 predicts the token at a + j
        target = slots[..., 1:]
        counted = real[..., None] & (target < t) & loss_mask.gather(
            1, target.clamp(max=t - 1).flatten(1)).view_as(target).bool()
        # per slot, the rows that count and their teacher rows (the target at a + j - 1): the fused head loss
        # runs the LM head over those rows only, a chunk at a time (train.kernels.loss_chunk)
        xs, teacher_rows = [], []
        for j in range(block - 1):
            b_idx, a_idx = counted[..., j].nonzero(as_tuple=True)
            xs.append(hidden[b_idx, a_idx, j])
            teacher_rows.append(b_idx * t + target[b_idx, a_idx, j] - 1)
        count = counted.sum((0, 1)).float()
        weights = self.decay ** torch.arange(block - 1, device=dev, dtype=torch.float32)
        rows = TeacherRows(teacher.p.flatten(0, 1), teacher.top.flatten(), teacher.mass.flatten())
        out = draft_head_loss(xs, d.lm_head, rows, teacher_rows, weights / (count * weights).sum().clamp(min=1),
                              self.loss_chunk, self.loss)
        return out.total, {"loss_sum": out.loss_sums, "correct": out.correct.float(), "alpha_sum": out.alpha_sums,
                           "count": count}
