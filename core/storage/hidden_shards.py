"""Hidden-state shards (extract -> train): the one writer and the one reader.

    hidden/shard-00000.safetensors   input_ids int32 [N], loss_mask uint8 [N], aux [N, 3H], final [M, H]
                                     (+ aux_scale [N, 3], final_scale [M] fp32 when stored as fp8 e4m3)
    hidden/index.jsonl               append-only: {"id", "shard", "offset", "length", "sha256", "crc32"}
                                     (+ "final_offset", "final_length" when final is stored on loss spans)

Integrity: `crc32` holds a checksum of each stored tensor's rows of the sample, checked whenever they are
read: a flipped byte in aux or final stops training naming the shard and sample instead of training on
garbage (`sha256` of input_ids is the sample's identity).

Storage options: dtype bf16 (default) | fp32 | fp8_e4m3 (core/storage/fp8_rows.py, ~0.5x bf16), and
spans all (M = N) | loss: final rows only at the positions whose teacher distribution the loss reads
(j with loss_mask[j+1] = 1); aux stays on every token because the drafter attends over the prompt.
The reader hides both: it returns aux [T, 3H] and final [T, H] (zeros where final was not stored).

A shard is committed (temp + fsync + rename) before its samples enter the index, so after a kill
the index names only whole shards; a committed shard missing from the index is an orphan that the
next writer overwrites, and its samples are simply extracted again. Commits run on background
threads (two shards in flight at most), so the engine's next forwards overlap the writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
import threading
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from core.run.errors import UserError
from core.storage.atomic_io import append_jsonl, atomic_write, read_jsonl, remove_partial_writes, repair_jsonl
from core.storage.fp8_rows import FP8, dequantize_rows, quantize_rows

log = logging.getLogger(__name__)

INDEX = "index.jsonl"
_SHARD_RE = re.compile(r"shard-(\d{5})\.safetensors$")
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8_e4m3": FP8}
SPANS = ("all", "loss")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", FP8: "F8_E4M3", torch.int32: "I32",
                       torch.uint8: "U8"}


class SampleMismatch(ValueError):
    """A sample's rows do not belong to, or do not cover, its tokens; it is reported, never written."""


def ids_sha256(input_ids: torch.Tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(input_ids.numpy().astype(np.int32)).tobytes()).hexdigest()


def crc32(x: torch.Tensor) -> int:
    return zlib.crc32(x.contiguous().view(torch.uint8).numpy())


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]]) -> None:
    """The safetensors layout (u64 header length, JSON header padded to 8 bytes, raw little-endian
    data), each tensor the dim-0 concatenation of its CPU chunks, written straight from their memory:
    no concatenated or serialised copy of a 256 MB shard, and the GIL is released while the bytes go
    to disk, so commits overlap the engine's forwards."""
    header, offset = {}, 0
    for name, chunks in tensors.items():
        n = sum(c.numel() * c.element_size() for c in chunks)
        shape = [sum(c.shape[0] for c in chunks), *chunks[0].shape[1:]]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[chunks[0].dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for chunks in tensors.values():
            for c in chunks:
                f.write(c.contiguous().view(torch.uint8).numpy().data)


def teacher_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[..., T] -> bool [..., T]: positions j whose target distribution the loss reads (token j+1 is
    trained on; in packed rows, doc_ids [..., T], also in j's document). The one copy of this rule:
    extract keeps `final` there, train computes teachers there."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    need[..., :-1] = loss_mask[..., 1:].bool()
    if doc_ids is not None:
        need[..., :-1] &= doc_ids[..., 1:] == doc_ids[..., :-1]
    return need


def check_sample(sample_id: str, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, hidden: int,
                 seen_ids=None) -> None:
    """The checks every engine's rows pass before they are written: the engine ran exactly these
    tokens (seen_ids), one aux [3H] and one final [H] row per token, all finite."""
    t = input_ids.numel()
    if seen_ids is not None and torch.as_tensor(seen_ids).reshape(-1).tolist() != input_ids.tolist():
        raise SampleMismatch(f"sample {sample_id!r}: the engine's token ids differ from the sample's")
    if aux.shape != (t, 3 * hidden) or final.shape != (t, hidden):
        raise SampleMismatch(f"sample {sample_id!r}: aux {tuple(aux.shape)} / final {tuple(final.shape)} rows "
                             f"for T={t} tokens, H={hidden}")
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise SampleMismatch(f"sample {sample_id!r}: non-finite hidden states")


class ShardWriter:
    """Buffers samples and commits them a shard at a time on background threads (memory: the shard
    being filled plus at most two in flight). Use as a context manager; flush() waits for the disk."""

    MAX_IN_FLIGHT = 2

    def __init__(self, out_dir: Path, hidden_size: int, dtype: str = "bf16", shard_mb: int = 256,
                 spans: str = "all"):
        if dtype not in STORAGE_DTYPES:
            raise UserError(f"extract.dtype = {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
        if spans not in SPANS:
            raise UserError(f"extract.spans = {spans!r}; use one of {list(SPANS)}")
        self.dir, self.hidden, self.dtype, self.spans = Path(out_dir), hidden_size, STORAGE_DTYPES[dtype], spans
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
        remove_partial_writes(self.dir)  # a commit cut short by a kill
        self._buf: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._buf_bytes = 0
        self._queued: set[str] = set()  # buffered or in flight
        self._commits = ThreadPoolExecutor(self.MAX_IN_FLIGHT, thread_name_prefix="shard-commit")
        self._in_flight: deque[Future] = deque()
        self._index_lock = threading.Lock()
        self._copies_done: torch.cuda.Event | None = None  # the last device-to-host copy queued

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        """GPU rows go to pinned host memory without blocking (the copy engine runs while the next
        sample is checked); _submit waits for the copies before the commit thread reads them."""
        if x.device.type != "cuda":
            return x.cpu()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        self._copies_done = torch.cuda.Event()
        self._copies_done.record()
        return host

    def _encode(self, name: str, x: torch.Tensor, groups: int) -> dict[str, torch.Tensor]:
        if self.dtype == FP8:
            q, scale = quantize_rows(x.detach(), groups)  # on the engine's device, before the copy
            return {name: self._to_host(q), f"{name}_scale": self._to_host(scale if groups > 1 else scale[:, 0])}
        return {name: self._to_host(x.detach().to(self.dtype))}

    def add(self, sample_id: str, input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor,
            seen_ids=None) -> None:
        """Validate (check_sample) and buffer one sample; raises SampleMismatch and writes nothing if wrong."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.int32).cpu()
        loss_mask = torch.as_tensor(loss_mask, dtype=torch.uint8).cpu()
        if sample_id in self.done or sample_id in self._queued:
            raise ValueError(f"sample {sample_id!r} written twice")
        if loss_mask.shape != input_ids.shape:
            raise SampleMismatch(f"sample {sample_id!r}: loss_mask {tuple(loss_mask.shape)} for "
                                 f"{input_ids.numel()} tokens")
        check_sample(sample_id, input_ids, aux, final, self.hidden, seen_ids)
        if self.spans == "loss":
            final = final[teacher_positions(loss_mask).to(final.device)]
        tensors = {"input_ids": input_ids, "loss_mask": loss_mask,
                   **self._encode("aux", aux, 3), **self._encode("final", final, 1)}
        self._buf.append((sample_id, tensors))
        self._queued.add(sample_id)
        self._buf_bytes += sum(x.numel() * x.element_size() for x in tensors.values())
        if self._buf_bytes >= self.shard_bytes:
            self._submit()

    def _submit(self) -> None:
        """Hand the buffer to a commit thread, once fewer than MAX_IN_FLIGHT shards are in flight."""
        while len(self._in_flight) >= self.MAX_IN_FLIGHT:
            self._in_flight.popleft().result()
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None
        if self._buf:
            name, buf = shard_name(self.next_shard), self._buf
            self.next_shard += 1
            self._buf, self._buf_bytes = [], 0
            self._in_flight.append(self._commits.submit(self._commit, name, buf))

    def _wait(self) -> None:
        """Block until every shard in flight is committed and indexed; raise the first error here."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def flush(self) -> None:
        """Commit everything buffered; on return it is on disk and in the index."""
        self._submit()
        self._wait()

    def _commit(self, name: str, buf: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
        chunks = {k: [t[k] for _, t in buf] for k in buf[0][1]}
        atomic_write(self.dir / name, lambda p: write_safetensors(p, chunks))
        rows, offset, final_offset = [], 0, 0
        for sid, t in buf:
            n, m = t["input_ids"].numel(), t["final"].shape[0]
            row = {"id": sid, "shard": name, "offset": offset, "length": n, "sha256": ids_sha256(t["input_ids"]),
                   "crc32": {k: crc32(x) for k, x in t.items()}}
            if self.spans == "loss":
                row.update(final_offset=final_offset, final_length=m)
            rows.append(row)
            offset, final_offset = offset + n, final_offset + m
        with self._index_lock:  # two commit threads; each shard's lines land whole
            append_jsonl(self.dir / INDEX, rows)
            self.done.update(r["id"] for r in rows)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        try:
            if exc_type is None:
                self._submit()
            self._wait()  # shards in flight are whole: let them land even when the run failed
        finally:
            self._commits.shutdown()


class HiddenShards:
    """Random access to extracted samples by id (memory-mapped slices, hash-checked, fp8 dequantized)."""

    def __init__(self, in_dir: Path):
        self.dir = Path(in_dir)
        if not (self.dir / INDEX).is_file():
            raise UserError(f"{self.dir / INDEX} missing: run `make extract` first")
        self.rows = {r["id"]: r for r in read_jsonl(self.dir / INDEX)}
        self.ids = sorted(self.rows)
        self.final_everywhere = not any("final_length" in r for r in self.rows.values())
        self._files: dict[str, tuple[object, set[str]]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def num_tokens(self) -> int:
        return sum(r["length"] for r in self.rows.values())

    def digest(self) -> str:
        """What the shards hold (ids and checksums), for the provenance of what is trained on them."""
        rows = sorted((r["id"], r["sha256"], sorted(r.get("crc32", {}).items())) for r in self.rows.values())
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    def _file(self, shard: str):
        if shard not in self._files:
            try:
                f = safe_open(str(self.dir / shard), framework="pt")
            except (SafetensorError, OSError) as e:  # truncated, overwritten or missing
                raise UserError(f"{self.dir / shard}: unreadable shard ({e}); re-extract it: "
                                "`python -m extract --fresh ...`") from None
            self._files[shard] = (f, set(f.keys()))
        return self._files[shard]

    def _checked(self, r: dict, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of one stored tensor, verified against the index's checksum of this sample."""
        x = self._file(r["shard"])[0].get_slice(name)[lo:hi]
        want = r.get("crc32", {}).get(name)
        if want is not None and crc32(x) != want:
            raise UserError(f"{self.dir / r['shard']}: sample {r['id']!r}: {name} fails its checksum (corrupt shard); "
                            "re-extract: `python -m extract --fresh ...`")
        return x

    def _rows(self, r: dict, name: str, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """{name: rows lo:hi as stored, name_scale [n, groups]: their fp8 scales, if stored so}."""
        out = {name: self._checked(r, name, lo, hi)}
        if f"{name}_scale" in self._file(r["shard"])[1]:
            scale = self._checked(r, f"{name}_scale", lo, hi)
            out[f"{name}_scale"] = scale if scale.dim() == 2 else scale[:, None]
        return out

    def load(self, sample_id: str, names=("input_ids", "loss_mask", "aux", "final"),
             decode: bool = True) -> dict[str, torch.Tensor]:
        """One sample's tensors; aux [T, 3H] and final [T, H] (zero rows where final was not stored; fp8 as fp32), or
        with decode=False as stored (bf16, or fp8 with aux_scale [T, 3] / final_scale [T, 1] beside them, zero
        where no row was stored): `decode_hidden` then makes the rows wherever the tensors are (training
        dequantizes on its GPU: a quarter of the bytes to read and copy there, no CPU pass over them)."""
        r = self.rows[sample_id]
        lo, hi = r["offset"], r["offset"] + r["length"]
        out = {k: self._checked(r, k, lo, hi) for k in names if k not in ("aux", "final")}
        for k in (k for k in ("aux", "final") if k in names):
            if k == "final" and "final_length" in r:  # loss spans: scattered back by the mask
                out.update(self._sparse_final(r, out["loss_mask"] if "loss_mask" in out else
                                              self._checked(r, "loss_mask", lo, hi)))
            else:
                out.update(self._rows(r, k, lo, hi))
        if "input_ids" in out and ids_sha256(out["input_ids"]) != r["sha256"]:
            raise UserError(f"{self.dir / r['shard']}: sample {r['id']!r} input_ids hash mismatch (corrupt shard)")
        return decode_hidden(out) if decode else out

    def _sparse_final(self, r: dict, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """final stored on loss spans only -> [T, H] as stored (and its scales [T, 1]), zero rows where the loss
        never reads it."""
        need = teacher_positions(loss_mask)
        if int(need.sum()) != r["final_length"]:
            raise UserError(f"{self.dir / r['shard']}: sample {r['id']!r} has {r['final_length']} final rows for "
                            f"{int(need.sum())} loss positions (corrupt shard)")
        out = {}
        for name, rows in self._rows(r, "final", r["final_offset"], r["final_offset"] + r["final_length"]).items():
            bits = rows.view(torch.uint8) if rows.dtype == FP8 else rows  # fp8 has no CPU scatter; 0x00 is +0.0
            full = bits.new_zeros(r["length"], rows.shape[1])
            full[need] = bits
            out[name] = full.view(rows.dtype)
        return out


def decode_hidden(tensors: dict[str, torch.Tensor], to_float: bool = False) -> dict[str, torch.Tensor]:
    """aux / final as stored (HiddenShards.load(decode=False), one sample [T, ...] or a collated batch [B, T, ...],
    fp8 with their `_scale` tensors) -> fp8 dequantized to fp32 (bf16 kept, or fp32 too with to_float), on the
    tensors' own device; the scales are consumed."""
    out = dict(tensors)
    for name in ("aux", "final"):
        if name not in out:
            continue
        scale = out.pop(f"{name}_scale", None)
        x = out[name]
        if scale is None:
            out[name] = x.float() if to_float else x
        else:
            rows = dequantize_rows(x.reshape(-1, x.shape[-1]), scale.reshape(-1, scale.shape[-1]))
            out[name] = rows.reshape(x.shape)
    return out
