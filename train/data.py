"""Samples from hidden shards, padded into batches (right padding; causal attention never looks right)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from core.hidden_shards import HiddenShards


class ShardDataset(Dataset):
    def __init__(self, shards: HiddenShards, ids: list[str], max_len: int):
        self.shards, self.ids, self.max_len = shards, ids, max_len

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.shards.load(self.ids[i])
        return {k: v[: self.max_len] for k, v in s.items()}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    t = max(s["input_ids"].numel() for s in samples)
    b = len(samples)
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.uint8),
        "aux": torch.zeros(b, t, samples[0]["aux"].shape[-1]),
        "final": torch.zeros(b, t, samples[0]["final"].shape[-1]),
    }
    for i, s in enumerate(samples):
        n = s["input_ids"].numel()
        out["input_ids"][i, :n] = s["input_ids"].long()
        out["loss_mask"][i, :n] = s["loss_mask"]
        out["aux"][i, :n] = s["aux"].float()
        out["final"][i, :n] = s["final"].float()
    return out
