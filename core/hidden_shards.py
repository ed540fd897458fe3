"""Hidden-state shards (extract -> train): the one writer and the one reader.

    hidden/shard-00000.safetensors   input_ids int32 [N], loss_mask uint8 [N], aux [N, 3H], final [N, H]
    hidden/index.jsonl               append-only: {"id", "shard", "offset", "length", "sha256"}

A shard is committed (temp + fsync + rename) before its samples enter the index, so after a kill
the index names only whole shards; a committed shard missing from the index is an orphan that the
next writer overwrites, and its samples are simply extracted again.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.atomic_io import append_jsonl, atomic_write, read_jsonl, repair_jsonl

log = logging.getLogger(__name__)

INDEX = "index.jsonl"
_SHARD_RE = re.compile(r"shard-(\d{5})\.safetensors$")
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def ids_sha256(input_ids: torch.Tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(input_ids.numpy().astype(np.int32)).tobytes()).hexdigest()


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


class ShardWriter:
    """Buffers samples and commits them a shard at a time. Use as a context manager."""

    def __init__(self, out_dir: Path, hidden_size: int, dtype: str = "bfloat16", shard_mb: int = 256):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"extract.dtype = {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
        self.dir, self.hidden, self.dtype = Path(out_dir), hidden_size, STORAGE_DTYPES[dtype]
        self.shard_bytes = shard_mb * 2**20
        self.dir.mkdir(parents=True, exist_ok=True)
        repair_jsonl(self.dir / INDEX)
        rows = read_jsonl(self.dir / INDEX)
        self.done: set[str] = {r["id"] for r in rows}
        indexed = {r["shard"] for r in rows}
        self.next_shard = 1 + max((int(_SHARD_RE.match(s).group(1)) for s in indexed), default=-1)
        for orphan in self.dir.glob("shard-*.safetensors"):
            if orphan.name not in indexed:
                log.info("removing %s: committed but not indexed before a crash; its samples re-run", orphan)
                orphan.unlink()
        self._buf: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._buf_bytes = 0

    def add(self, sample_id: str, input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor) -> None:
        input_ids = torch.as_tensor(input_ids, dtype=torch.int32).cpu()
        loss_mask = torch.as_tensor(loss_mask, dtype=torch.uint8).cpu()
        t = input_ids.numel()
        if sample_id in self.done or any(s == sample_id for s, _ in self._buf):
            raise ValueError(f"sample {sample_id!r} written twice")
        if loss_mask.shape != (t,) or aux.shape != (t, 3 * self.hidden) or final.shape != (t, self.hidden):
            raise ValueError(f"sample {sample_id!r}: shapes input_ids {tuple(input_ids.shape)} loss_mask "
                             f"{tuple(loss_mask.shape)} aux {tuple(aux.shape)} final {tuple(final.shape)} "
                             f"do not match T={t}, H={self.hidden}")
        if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
            raise ValueError(f"sample {sample_id!r}: non-finite hidden states")
        tensors = {"input_ids": input_ids, "loss_mask": loss_mask,
                   "aux": aux.detach().to("cpu", self.dtype), "final": final.detach().to("cpu", self.dtype)}
        self._buf.append((sample_id, tensors))
        self._buf_bytes += sum(x.numel() * x.element_size() for x in tensors.values())
        if self._buf_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        name = shard_name(self.next_shard)
        merged = {k: torch.cat([t[k] for _, t in self._buf]).contiguous() for k in self._buf[0][1]}
        atomic_write(self.dir / name, lambda p: save_file(merged, str(p)))
        rows, offset = [], 0
        for sid, t in self._buf:
            n = t["input_ids"].numel()
            rows.append({"id": sid, "shard": name, "offset": offset, "length": n,
                         "sha256": ids_sha256(t["input_ids"])})
            offset += n
        append_jsonl(self.dir / INDEX, rows)
        self.done.update(r["id"] for r in rows)
        self.next_shard += 1
        self._buf, self._buf_bytes = [], 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.flush()


class HiddenShards:
    """Random access to extracted samples by id (memory-mapped slices, hash-checked)."""

    def __init__(self, in_dir: Path):
        self.dir = Path(in_dir)
        if not (self.dir / INDEX).is_file():
            raise FileNotFoundError(f"{self.dir / INDEX} missing: run `make extract` first")
        self.rows = {r["id"]: r for r in read_jsonl(self.dir / INDEX)}
        self.ids = sorted(self.rows)
        self._files: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def num_tokens(self) -> int:
        return sum(r["length"] for r in self.rows.values())

    def _file(self, shard: str):
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._files[shard]

    def load(self, sample_id: str, names=("input_ids", "loss_mask", "aux", "final")) -> dict[str, torch.Tensor]:
        r = self.rows[sample_id]
        f = self._file(r["shard"])
        lo, hi = r["offset"], r["offset"] + r["length"]
        out = {k: f.get_slice(k)[lo:hi] for k in names}
        if "input_ids" in out and ids_sha256(out["input_ids"]) != r["sha256"]:
            raise ValueError(f"{self.dir / r['shard']}: sample {sample_id!r} input_ids hash mismatch (corrupt shard)")
        return out
