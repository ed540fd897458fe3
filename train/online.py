"""train.source=online: the frozen target runs in the training process and captures each batch's
hidden states (aux + final) straight from data_gen's conversations, so no shards are written.

    python -m train --config configs/<name>.yaml train.source=online

The capture is extract's (core/target/hidden_capture.py) with extract's keys (extract.aux_layers,
extract.mixed_precision; the target in target.dtype on the training device, one copy per process),
so online and offline training read the same tensors, except that offline shards store them in
extract.dtype, and that aux_rms reads the first samples cut at train.max_len (as trained; offline
reads them whole). Cost: one target forward per batch per epoch, instead of one per sample at extract.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from core.run.config import RunConfig
from core.run.errors import UserError
from core.storage.conversations import read_conversations_for
from core.storage.hidden_shards import ids_sha256, teacher_positions
from core.target.aux_layers import resolve_aux_layers
from core.target.hidden_capture import capture, capture_compat
from core.target.model import TargetHead, check_target_fits, load_target, resolve_precision, target_info
from train.data import AUX_RMS_SAMPLES, collate
from train.deepspeed_config import whole_modules
from train.ttt_loss import teacher_argmax_lse


class ConversationDataset(Dataset):
    """Tokenized conversations by position in `order`: {id, input_ids [T], loss_mask [T]}, T <= max_len."""

    def __init__(self, rows, order: list[int], ids: list[str], max_len: int):
        self.rows, self.order, self.ids, self.max_len = rows, order, ids, max_len

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[self.order[i]]
        return {"id": self.ids[i], "input_ids": torch.as_tensor(np.asarray(row["input_ids"][: self.max_len])),
                "loss_mask": torch.as_tensor(np.asarray(row["loss_mask"][: self.max_len]))}


class OnlineSource:
    """The conversations in <run>/conversations, captured batch by batch by the target on `device`
    (the interface of train/data.py's sources)."""

    def __init__(self, cfg: RunConfig, device: torch.device):
        check_target_fits(cfg, device)  # every training process holds a whole target: refused here, not at load
        self.dir, self.max_len, self.device = cfg.run_path / "conversations", cfg.train.max_len, device
        self.manifest, convs = read_conversations_for(self.dir, cfg.target.model)
        convs = convs.select_columns(["id", "input_ids", "loss_mask"])
        ids = convs["id"]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise UserError(f"{self.dir}: sample id {dup!r} appears more than once; regenerate the conversations")
        order = sorted(range(len(ids)), key=ids.__getitem__)  # the shards' order: the same batches either way
        self.ids = [ids[i] for i in order]
        full = pc.list_value_length(convs.data.table.column("input_ids")).to_pylist()
        self.lengths = [min(full[i], self.max_len) for i in order]
        self._num_tokens = sum(full)
        self.ds = ConversationDataset(convs.with_format("numpy"), order, self.ids, self.max_len)
        info = target_info(cfg)
        self.aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.num_layers)
        self.compat, self.inputs = capture_compat(cfg, info, self.aux_layers), {"conversations": str(self.dir)}
        self.precision = resolve_precision(cfg.extract.mixed_precision)
        self.capture_settings = {"conversations": self.manifest.get("fingerprint"), "aux_layers": self.aux_layers,
                                 "target.dtype": cfg.target.dtype, "capture_precision": self.precision}
        self.cfg, self.head, self.on_prompt = cfg, None, False

    @functools.cached_property
    def model(self):
        """The frozen target, loaded at its first capture (after the run's settings were checked). Its loading
        leaves the RNG alone, so the drafter starts from the same weights as in an offline run."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), whole_modules():
            return load_target(self.cfg, self.device)[0]

    def settings(self) -> dict:
        """The data's part of the run's settings: one key `online` (what the captures are made from and how),
        where offline runs have `hidden`; so a switch of train.source is a changed setting."""
        return {"online": self.capture_settings, "data": self.digest(), "samples": len(self.ids)}

    def digest(self) -> str:
        """What the conversations hold (ids, token and mask checksums): grown or regenerated data trains anew."""
        rows = [(sid, ids_sha256(s["input_ids"]), hashlib.sha256(s["loss_mask"].numpy().tobytes()).hexdigest())
                for sid, s in self._full_samples()]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    def num_tokens(self) -> int:
        return self._num_tokens

    def _full_samples(self, n: int | None = None) -> Iterator[tuple[str, dict]]:
        """(id, {input_ids, loss_mask} at full length) in sorted-id order."""
        for i, sid in enumerate(self.ids[:n]):
            row = self.ds.rows[self.ds.order[i]]
            yield sid, {k: torch.as_tensor(np.asarray(row[k])) for k in ("input_ids", "loss_mask")}

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _, s in self._full_samples():
            yield s["input_ids"], s["loss_mask"]

    def aux_samples(self, batch_size: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Captures of the first AUX_RMS_SAMPLES samples (truncated to max_len, as trained on), a batch at a time."""
        n = min(AUX_RMS_SAMPLES, len(self.ids))
        for start in range(0, n, batch_size):
            batch = collate([self.ds[i] for i in range(start, min(n, start + batch_size))])
            aux, _ = self._capture(batch)
            for i in range(aux.shape[0]):  # padding rows are loss_mask 0: they never count
                yield aux[i], batch["loss_mask"][i].to(aux.device)

    def dataset(self, target: TargetHead, matmul_dtype: torch.dtype, on_prompt: bool) -> ConversationDataset:
        """The teacher argmax is taken per batch in `complete`, with the loaded target's own lm_head (the same
        values as target.lm_head; no second copy on the device when target.dtype is the matmul dtype)."""
        self.head, self.on_prompt = self.model.get_output_embeddings().weight.to(matmul_dtype), on_prompt
        return self.ds

    def _capture(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """-> aux [B,T,3H], final [B,T,H] in fp32, zero on padding (as collate pads shard rows)."""
        ids, valid = batch["input_ids"].to(self.device), batch["valid"].to(self.device)
        aux, final = capture(self.model, ids, valid.long(), self.aux_layers, self.precision)
        keep = valid[..., None].bool()
        return aux.float().masked_fill(~keep, 0), final.float().masked_fill(~keep, 0)

    def complete(self, batch: dict) -> dict:
        """A collated batch (on the device) + aux, final and the full-vocab teacher argmax and logsumexp [B,T] at
        the positions that are ever a teacher target (what precompute_teacher stores offline)."""
        aux, final = self._capture(batch)
        need = teacher_positions(batch["valid"] if self.on_prompt else batch["loss_mask"]).to(self.device)
        argmax = torch.zeros(need.shape, dtype=torch.long, device=self.device)
        lse = torch.zeros(need.shape, dtype=torch.float32, device=self.device)
        argmax[need], lse[need] = teacher_argmax_lse(final[need], self.head)
        return {**batch, "aux": aux, "final": final, "argmax": argmax, "teacher_lse": lse}

    def where(self, ids: list[str]) -> str:
        return f"{self.dir} (online captures)"
