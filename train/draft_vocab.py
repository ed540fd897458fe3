"""Draft vocabulary: the most frequent target tokens at loss-masked (assistant) positions.

d2t[i] = target_id(i) - i (SGLang builds hot ids as d2t + arange); t2d = bool mask over the target vocab.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from core.run.errors import UserError


def token_counts(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts of each target id at loss-masked positions over (input_ids [T], loss_mask [T]) pairs: the
    samples' full lengths, whether they come from hidden shards or straight from the conversations."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in samples:
        counts += torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)
    return counts


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int) -> None:
    if not 0 < draft_vocab_size <= vocab_size:
        raise UserError(f"train.draft_vocab_size = {draft_vocab_size}: must be in [1, {vocab_size}] (the target's vocab)")


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """-> (draft_ids ascending [Vd], t2d bool [V], coverage of masked tokens). Ties and unseen fill
    by lowest id, so the choice is deterministic."""
    vocab_size = counts.numel()
    check_draft_vocab_size(draft_vocab_size, vocab_size)
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices
    draft_ids = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    total = int(counts.sum())
    coverage = float(counts[draft_ids].sum()) / total if total else 0.0
    return draft_ids, t2d, coverage


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids - torch.arange(draft_ids.numel())


COUNTS_FILE = "draft_vocab_counts.json"  # beside an exported drafter: how often training saw each draft token


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """d2t offsets [Vd] -> the target id of each draft index (the inverse of d2t_offsets)."""
    return d2t + torch.arange(d2t.numel())


def counts_record(target_ids: torch.Tensor, counts: torch.Tensor, source: str) -> dict:
    """What COUNTS_FILE holds: per draft index (d2t order) its target id and count, and where the counts
    come from. The ids bind the counts to one draft vocab: read against another, they are refused."""
    return {"source": source, "target_ids": target_ids.tolist(), "counts": counts.tolist()}


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts [Vd] per draft index -> the `size` most frequent draft indices, ascending (ties: lowest index)."""
    if not 0 < size < counts.numel():
        raise UserError(f"draft vocab size {size}: must be in [1, {counts.numel() - 1}] to prune a drafter whose "
                        f"draft vocab has {counts.numel()} tokens")
    return torch.sort(torch.sort(-counts, stable=True).indices[:size]).values


def prune_draft_vocab(sd: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """An SGLang-format drafter's tensors with only the draft indices `keep` (ascending): lm_head rows, d2t
    and t2d follow. The kept rows' logits are the same numbers, so a greedy draft equals the full drafter's
    wherever that one lies in `keep` (FR-Spec's frequency-ranked draft head, cut after training)."""
    target_ids = target_ids_of(sd["d2t"])[keep]
    t2d = torch.zeros_like(sd["t2d"])
    t2d[target_ids] = True
    return {**sd, "lm_head.weight": sd["lm_head.weight"][keep].contiguous(), "d2t": d2t_offsets(target_ids), "t2d": t2d}
