"""Samples from hidden shards, padded into batches (right padding; causal attention never looks right)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from core.errors import UserError
from core.hidden_shards import HiddenShards, teacher_positions
from train.ttt_loss import teacher_argmax


class ShardDataset(Dataset):
    """Samples truncated to max_len; `extra[name][id]` adds per-token tensors (e.g. the teacher argmax)."""

    def __init__(self, shards: HiddenShards, ids: list[str], max_len: int, extra: dict | None = None):
        self.shards, self.ids, self.max_len, self.extra = shards, ids, max_len, extra or {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.shards.load(self.ids[i])
        s.update({name: per_id[self.ids[i]] for name, per_id in self.extra.items()})
        return {"id": self.ids[i], **{k: v[: self.max_len] for k, v in s.items()}}


def precompute_argmax(shards: HiddenShards, head: torch.Tensor, max_len: int, on_prompt: bool) -> dict[str, torch.Tensor]:
    """Per sample, the target's full-vocab argmax at every position that is ever a teacher target
    (0 elsewhere), computed once instead of once per epoch."""
    out = {}
    for sid in tqdm(shards.ids, desc="teacher argmax", unit="sample"):
        s = shards.load(sid, names=("loss_mask", "final"))
        need = teacher_positions(torch.ones_like(s["loss_mask"]) if on_prompt else s["loss_mask"])
        need[max_len:] = False
        arg = torch.zeros(need.shape[0], dtype=torch.long)
        if need.any():
            arg[need] = teacher_argmax(s["final"][need].to(head.device), head).cpu()
        out[sid] = arg
    return out


def length_grouped_batches(lengths: list[int], batch_size: int, seed: int, group: int = 16) -> list[list[int]]:
    """Shuffled batches of samples of similar length: each run of `group` batches' worth of shuffled
    samples is sorted by length before cutting, then batch order is shuffled. Padding, and the O(T^2)
    TTT attention over it, shrinks without ordering the epoch by length."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    span = batch_size * group
    batches = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def slot_batches(ds: Dataset, batches: list[list[int]], slots: list, device: torch.device):
    """The collated batches of a rank's slots (train/position.py), in order, on `device`."""
    for batch in DataLoader(ds, batch_sampler=[batches[s.batch] for s in slots], collate_fn=collate):
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def aux_rms(shards: HiddenShards, max_samples: int = 128) -> torch.Tensor:
    """Per-feature RMS of aux [3H] over assistant positions (where massive-activation sink tokens,
    e.g. the first token, are rare) of the first max_samples samples."""
    total, count = None, 0
    for sid in shards.ids[:max_samples]:
        s = shards.load(sid, names=("aux", "loss_mask"))
        a = s["aux"][s["loss_mask"].bool()].float()
        total = a.pow(2).sum(0) if total is None else total + a.pow(2).sum(0)
        count += a.shape[0]
    if not count:
        raise UserError(f"{shards.dir}: no assistant tokens in the first {max_samples} samples")
    return (total / count).sqrt().clamp(min=1e-3)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    t = max(s["input_ids"].numel() for s in samples)
    b = len(samples)
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.uint8),
        "valid": torch.zeros(b, t, dtype=torch.uint8),  # 1 on real tokens, 0 on padding
        "aux": torch.zeros(b, t, samples[0]["aux"].shape[-1]),
        "final": torch.zeros(b, t, samples[0]["final"].shape[-1]),
    }
    if "argmax" in samples[0]:
        out["argmax"] = torch.zeros(b, t, dtype=torch.long)
    out["ids"] = [s["id"] for s in samples]  # named when a batch goes wrong (non-finite loss)
    for i, s in enumerate(samples):
        n = s["input_ids"].numel()
        out["input_ids"][i, :n] = s["input_ids"].long()
        out["loss_mask"][i, :n] = s["loss_mask"]
        out["valid"][i, :n] = 1
        out["aux"][i, :n] = s["aux"].float()
        out["final"][i, :n] = s["final"].float()
        if "argmax" in s:
            out["argmax"][i, :n] = s["argmax"]
    return out
