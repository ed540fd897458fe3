"""Sequence packing (train.kernels.pack_length): a right-padded batch -> rows of exactly pack_length tokens holding
several documents each: little padding, and torch.compile sees one row length (only the row count varies)
instead of every batch's padded length. train/fit.py packs each batch after its source completed it;
ttt_loss keeps the documents apart (doc_ids, positions), so a packed batch trains what the padded one does.
"""

from __future__ import annotations

import torch

from core.run.errors import UserError


def next_fit(lengths: list[int], pack_length: int) -> list[tuple[int, int, int, int]]:
    """-> (row, offset, document index in that row, length) per sample: in the batch's order, each sample
    goes to the current row if it fits, else opens the next. Deterministic, so a resumed run packs as before."""
    places, row, used, doc = [], 0, 0, 0
    for n in lengths:
        if n > pack_length:
            raise UserError(f"a sample of {n} tokens does not fit train.kernels.pack_length = {pack_length}: set "
                            f"train.kernels.pack_length >= train.max_len")
        if used + n > pack_length:
            row, used, doc = row + 1, 0, 0
        places.append((row, used, doc, n))
        used, doc = used + n, doc + 1
    return places


def pack(batch: dict, pack_length: int) -> dict:
    """A completed batch (every tensor [B,T,...], each sample left-aligned where `valid` is 1) -> the same
    keys with tensors [R,pack_length,...], zero past the documents, plus doc_ids [R,pack_length] (the
    document's index in its row, -1 on padding) and positions [R,pack_length] (0 at each document's start)."""
    b, t = batch["valid"].shape
    lengths = batch["valid"].sum(1).tolist()
    places = next_fit(lengths, pack_length)
    rows = places[-1][0] + 1
    src = torch.cat([torch.arange(k) + i * t for i, k in enumerate(lengths)])  # flat [B*T] index of each token
    dst = torch.cat([torch.arange(k) + r * pack_length + off for r, off, _, k in places])
    doc_ids = torch.full((rows * pack_length,), -1, dtype=torch.long)
    doc_ids[dst] = torch.cat([torch.full((k,), d) for _, _, d, k in places])
    positions = torch.zeros(rows * pack_length, dtype=torch.long)
    positions[dst] = torch.cat([torch.arange(k) for k in lengths])
    device = batch["valid"].device
    src, dst = src.to(device), dst.to(device)

    def packed(x: torch.Tensor) -> torch.Tensor:  # [B,T,...] -> [R,pack_length,...]
        assert x.shape[:2] == (b, t), (x.shape, b, t)
        out = x.new_zeros(rows * pack_length, *x.shape[2:])
        out[dst] = x.flatten(0, 1)[src]
        return out.view(rows, pack_length, *x.shape[2:])

    out = {k: packed(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["doc_ids"] = doc_ids.view(rows, pack_length).to(device)
    out["positions"] = positions.view(rows, pack_length).to(device)
    return out
