"""Where training samples come from (train.source), and how they are padded into batches (right
padding; causal attention never looks right).

A source gives the loop: `compat` (target, hidden size, aux layers, vocab), `inputs` and `settings` for
the manifests, `ids` (sorted) and `lengths`, `token_pairs()` and `aux_samples()` (the draft vocab's
counts and aux_rms), `dataset(...)`, `complete(batch)` (the batch as the TTT step reads it: aux, final
and the teacher argmax), and `where(ids)` (what to name when a batch goes wrong).
  offline  ShardSource here: the hidden shards extract wrote.
  online   train/online.py: the conversations, captured by the target in the training process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from core.config import RunConfig
from core.errors import UserError
from core.hidden_shards import HiddenShards, teacher_positions
from core.manifest import check_compat, read_finished_manifest
from core.target import TargetHead
from train.ttt_loss import teacher_argmax

AUX_RMS_SAMPLES = 128  # aux_rms reads the first this many samples (sorted ids)


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


class ShardSource:
    """train.source=offline: <run>/hidden, made by extract."""

    def __init__(self, cfg: RunConfig, device: torch.device):
        self.dir, self.device = cfg.run_path / "hidden", device
        self.manifest = read_finished_manifest(self.dir, "extract")
        check_compat(self.manifest, {"target": cfg.target.model}, self.dir)
        self.shards = HiddenShards(self.dir)
        if cfg.train.loss_on_prompt and not self.shards.final_everywhere:  # before anything is written
            raise UserError(f"train.loss_on_prompt needs final rows on every token, but {self.dir} was extracted "
                            "with extract.spans=loss: re-extract with extract.spans=all or set "
                            "train.loss_on_prompt=false")
        self.compat, self.inputs, self.ids = self.manifest["compat"], {"hidden": str(self.dir)}, self.shards.ids
        self.max_len = cfg.train.max_len
        self.lengths = [min(self.shards.rows[i]["length"], self.max_len) for i in self.ids]

    def settings(self) -> dict:
        """The data's part of the run's settings (unchanged since before train.source existed, so older
        offline runs still resume)."""
        return {"hidden": self.manifest.get("fingerprint"), "data": self.shards.digest(), "samples": len(self.ids)}

    def num_tokens(self) -> int:
        return self.shards.num_tokens()

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for sid in self.ids:
            s = self.shards.load(sid, names=("input_ids", "loss_mask"))
            yield s["input_ids"], s["loss_mask"]

    def aux_samples(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for sid in self.ids[:AUX_RMS_SAMPLES]:
            s = self.shards.load(sid, names=("aux", "loss_mask"))
            yield s["aux"], s["loss_mask"]

    def dataset(self, target: TargetHead, matmul_dtype: torch.dtype, on_prompt: bool) -> ShardDataset:
        """The samples with their teacher argmax, computed here once (the full-vocab lm_head on the device
        only meanwhile)."""
        head = target.lm_head.to(self.device, matmul_dtype)
        argmax = precompute_argmax(self.shards, head, self.max_len, on_prompt)
        return ShardDataset(self.shards, self.ids, self.max_len, {"argmax": argmax})

    def complete(self, batch: dict) -> dict:
        return batch  # the shards hold aux and final; the argmax was precomputed

    def where(self, ids: list[str]) -> str:
        return f"{self.dir} {sorted({self.shards.rows[i]['shard'] for i in ids})}"


def precompute_argmax(shards: HiddenShards, head: torch.Tensor, max_len: int, on_prompt: bool,
                      rows_per_call: int = 2048) -> dict[str, torch.Tensor]:
    """Per sample, the target's full-vocab argmax at every position that is ever a teacher target
    (0 elsewhere), computed once instead of once per epoch. The rows of several samples go through one
    product of >= rows_per_call rows: a sample's ~60 answer rows ran the 49k-row lm_head at ~70 GFLOP/s on
    a 2-core CPU, 2048 rows at ~150 (docs/PERFORMANCE.md)."""
    out, pending, rows = {}, [], []

    def flush():
        if rows:
            arg = teacher_argmax(torch.cat(rows).to(head.device), head).cpu()
            for (sid, need), part in zip(pending, arg.split([r.shape[0] for r in rows]), strict=True):
                out[sid][need] = part
            pending.clear()
            rows.clear()

    for sid in tqdm(shards.ids, desc="teacher argmax", unit="sample"):
        s = shards.load(sid, names=("loss_mask", "final"))
        need = teacher_positions(torch.ones_like(s["loss_mask"]) if on_prompt else s["loss_mask"])
        need[max_len:] = False
        out[sid] = torch.zeros(need.shape[0], dtype=torch.long)
        if need.any():
            pending.append((sid, need))
            rows.append(s["final"][need])
        if sum(r.shape[0] for r in rows) >= rows_per_call:
            flush()
    flush()
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


@torch.no_grad()
def aux_rms(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], where: str,
            norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature RMS of aux [3H] over the assistant positions (where massive-activation sink tokens, e.g.
    the first token, are rare) of (aux [T,3H], loss_mask [T]) pairs: the first AUX_RMS_SAMPLES samples, from
    shards or from online captures -> (RMS of the raw aux, RMS of fc's input: norm(aux) when a norm is given
    (norm_before_fc), else the raw one), in one pass (online, each pass is a target forward per batch).
    where: what the samples are, for the error."""
    raw, normed, count = 0, 0, 0
    for aux, loss_mask in samples:
        a = aux[loss_mask.bool()].float()
        raw = raw + a.pow(2).sum(0)
        if norm is not None:
            normed = normed + norm(a).pow(2).sum(0)
        count += a.shape[0]
    if not count:
        raise UserError(f"{where}: no assistant tokens in the first {AUX_RMS_SAMPLES} samples")
    raw = (raw / count).sqrt().clamp(min=1e-3)
    return raw, raw if norm is None else (normed / count).sqrt().clamp(min=1e-3)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, loss_mask, valid (1 on real tokens) [B,T], the samples' ids, and
    whichever of aux [B,T,3H] / final [B,T,H] (fp32) / argmax [B,T] the samples carry."""
    t = max(s["input_ids"].numel() for s in samples)
    b = len(samples)
    out = {"input_ids": torch.zeros(b, t, dtype=torch.long), "loss_mask": torch.zeros(b, t, dtype=torch.uint8),
           "valid": torch.zeros(b, t, dtype=torch.uint8)}
    for name in ("aux", "final"):
        if name in samples[0]:
            out[name] = torch.zeros(b, t, samples[0][name].shape[-1])
    if "argmax" in samples[0]:
        out["argmax"] = torch.zeros(b, t, dtype=torch.long)
    out["ids"] = [s["id"] for s in samples]  # named when a batch goes wrong (non-finite loss)
    for i, s in enumerate(samples):
        n = s["input_ids"].numel()
        out["input_ids"][i, :n] = s["input_ids"].long()
        out["loss_mask"][i, :n] = s["loss_mask"]
        out["valid"][i, :n] = 1
        for name in ("aux", "final", "argmax"):
            if name in s:
                out[name][i, :n] = s[name]
    return out
