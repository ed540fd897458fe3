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

import queue
import threading
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from core.run.config import RunConfig
from core.run.errors import UserError
from core.storage.hidden_shards import HiddenShards, decode_hidden, teacher_positions
from core.storage.manifest import check_compat, read_finished_manifest
from core.target.model import TargetHead
from train.ttt_loss import teacher_argmax_lse

AUX_RMS_SAMPLES = 128  # aux_rms reads the first this many samples (sorted ids)


class ShardDataset(Dataset):
    """Samples truncated to max_len, hidden states as stored (`decode_hidden` makes them fp32, on the device in
    training); `extra[name][id]` adds per-token tensors (e.g. the teacher argmax)."""

    def __init__(self, shards: HiddenShards, ids: list[str], max_len: int, extra: dict | None = None):
        self.shards, self.ids, self.max_len, self.extra = shards, ids, max_len, extra or {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.shards.load(self.ids[i], decode=False)
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
        """The samples with their teacher argmax and logsumexp, computed here once (the full-vocab lm_head on the
        device only meanwhile)."""
        head = target.lm_head.to(self.device, matmul_dtype)
        return ShardDataset(self.shards, self.ids, self.max_len, precompute_teacher(self.shards, head, self.max_len,
                                                                                    on_prompt))

    def complete(self, batch: dict) -> dict:
        return decode_hidden(batch, to_float=True)  # fp32, on the device; the argmax was precomputed

    def where(self, ids: list[str]) -> str:
        return f"{self.dir} {sorted({self.shards.rows[i]['shard'] for i in ids})}"


def precompute_teacher(shards: HiddenShards, head: torch.Tensor, max_len: int, on_prompt: bool,
                       rows_per_call: int = 2048) -> dict[str, dict[str, torch.Tensor]]:
    """{"argmax": {id: [T]}, "teacher_lse": {id: [T] fp32}}: per sample, the target's full-vocab argmax and
    logsumexp at every position that is ever a teacher target (0 elsewhere), computed once instead of once per
    epoch. The rows of several samples go through one product of >= rows_per_call rows: a sample's ~60 answer
    rows ran the 49k-row lm_head at ~70 GFLOP/s on a 2-core CPU, 2048 rows at ~150 (docs/PERFORMANCE.md)."""
    out, pending, rows = {"argmax": {}, "teacher_lse": {}}, [], []

    def flush():
        if rows:
            arg, lse = (x.cpu() for x in teacher_argmax_lse(torch.cat(rows).to(head.device), head))
            sizes = [r.shape[0] for r in rows]
            for (sid, need), a, s in zip(pending, arg.split(sizes), lse.split(sizes), strict=True):
                out["argmax"][sid][need], out["teacher_lse"][sid][need] = a, s
            pending.clear()
            rows.clear()

    for sid in tqdm(shards.ids, desc="teacher argmax", unit="sample"):
        s = shards.load(sid, names=("loss_mask", "final"), decode=False)
        # fp8 dequantized on the head's device
        final = decode_hidden({k: v.to(head.device) for k, v in s.items() if k != "loss_mask"})["final"]
        need = teacher_positions(torch.ones_like(s["loss_mask"]) if on_prompt else s["loss_mask"])
        need[max_len:] = False
        out["argmax"][sid] = torch.zeros(need.shape[0], dtype=torch.long)
        out["teacher_lse"][sid] = torch.zeros(need.shape[0], dtype=torch.float32)
        if need.any():
            pending.append((sid, need))
            rows.append(final[need.to(head.device)])
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


def slot_batches(ds: Dataset, batches: list[list[int]], slots: list, device: torch.device, ahead: int = 2):
    """The collated batches of a rank's slots (train/position.py), in order, on `device`. A thread reads and
    collates up to `ahead` batches ahead of the step; on CUDA into pinned memory, copied to the GPU on a stream of
    their own, so neither the disk nor the copy waits behind the step's kernels (bench/bench_train_loop.py)."""
    cuda = device.type == "cuda"
    copies = torch.cuda.Stream(device) if cuda else None
    for batch in read_ahead(lambda idx: collate([ds[i] for i in idx], pin=cuda),
                            [batches[s.batch] for s in slots], ahead):
        if not cuda:
            yield batch
            continue
        with torch.cuda.stream(copies):
            moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
        torch.cuda.current_stream(device).wait_stream(copies)
        for v in moved.values():  # made on the copy stream, used and freed on the step's
            if isinstance(v, torch.Tensor):
                v.record_stream(torch.cuda.current_stream(device))
        yield moved


def read_ahead(load, items: list, ahead: int) -> Iterator:
    """load(item) for each item, in order, computed on one thread up to `ahead` items before the consumer asks;
    its error is raised here, at the item that failed. Leaving the loop early stops the thread."""
    done, ready, stop = object(), queue.Queue(maxsize=ahead), threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                ready.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in items:
                if not put((load(item), None)):
                    return
            put((done, None))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, raised there
            put((None, e))

    thread = threading.Thread(target=work, name="batch-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            value, error = ready.get()
            if error is not None:
                raise error
            if value is done:
                return
            yield value
    finally:
        stop.set()
        thread.join()


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


def collate(samples: list[dict[str, torch.Tensor]], pin: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded batch [B,T,...] of the samples' per-token tensors, zero on padding: input_ids and argmax as
    int64, the rest in their own dtype (hidden states as stored: bf16, or fp8 with their scales), valid (1 on real
    tokens) [B,T], and the samples' ids. pin: in page-locked memory, for an asynchronous copy to a GPU."""
    t = max(s["input_ids"].numel() for s in samples)
    b = len(samples)
    out = {"valid": torch.zeros(b, t, dtype=torch.uint8, pin_memory=pin)}
    for name, x in samples[0].items():
        if isinstance(x, torch.Tensor):
            dtype = {"input_ids": torch.long, "argmax": torch.long, "loss_mask": torch.uint8}.get(name, x.dtype)
            out[name] = torch.zeros(b, t, *x.shape[1:], dtype=dtype, pin_memory=pin)
    out["ids"] = [s["id"] for s in samples]  # named when a batch goes wrong (non-finite loss)
    for i, s in enumerate(samples):
        n = s["input_ids"].numel()
        out["valid"][i, :n] = 1
        for name, x in s.items():
            if isinstance(x, torch.Tensor):
                out[name][i, :n] = x
    return out
