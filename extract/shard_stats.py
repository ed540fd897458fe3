"""`python -m extract stats`: what the hidden shards cost on disk, per token, beside the alternatives.

    python -m extract stats --config configs/smollm2-135m-instruct.yaml      # <run>/hidden
    python -m extract stats --hidden /path/to/hidden

Reads only the safetensors headers and the index, so it is instant on terabytes. Compares the
measured bytes/token with bf16 on every row (8H+5), SpecForge's layout (8H+16: bf16 hidden + target,
int64 ids + mask) and the user's Kimi-K2.5 dumps (4 x 7168 x 2 B = 57 KB/token, 924 GiB for 17.3M
tokens), projecting this storage to Kimi's H.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

from core.run.errors import UserError
from core.storage.atomic_io import read_jsonl
from core.storage.hidden_shards import INDEX

KIMI_H, KIMI_TOKENS, KIMI_GIB = 7168, 17.3e6, 924
ELEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4, "U8": 1, "I64": 8}


def read_header(path: Path) -> dict:
    """The safetensors JSON header: {name: {"dtype", "shape", "data_offsets"}} (no tensor data read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def storage_stats(hidden_dir: Path) -> dict:
    rows = read_jsonl(Path(hidden_dir) / INDEX)
    if not rows:
        raise UserError(f"{Path(hidden_dir) / INDEX}: no samples (run `make extract` first)")
    shards = sorted({r["shard"] for r in rows})
    per_tensor: Counter[str] = Counter()
    dtypes, file_bytes, final_rows, hidden = {}, 0, 0, 0
    for name in shards:
        path = Path(hidden_dir) / name
        file_bytes += path.stat().st_size
        for key, t in read_header(path).items():
            lo, hi = t["data_offsets"]
            per_tensor[key] += hi - lo
            dtypes[key] = t["dtype"]
            if key == "final":
                final_rows += t["shape"][0]
            if key == "aux":
                hidden = t["shape"][1] // 3
    tokens = sum(r["length"] for r in rows)
    return {"dir": str(hidden_dir), "samples": len(rows), "tokens": tokens, "shards": len(shards),
            "file_bytes": file_bytes, "tensor_bytes": dict(per_tensor), "dtypes": dtypes, "hidden": hidden,
            "final_fraction": final_rows / tokens}


def bytes_per_token_at(stats: dict, hidden: int) -> float:
    """This storage's bytes/token for a model of hidden size `hidden` (same dtypes, same final fraction)."""
    d, t = stats["dtypes"], stats["tokens"]
    tb = stats["tensor_bytes"]
    per = ELEM_BYTES[d["input_ids"]] + ELEM_BYTES[d["loss_mask"]] + ELEM_BYTES[d["aux"]] * 3 * hidden
    per += tb.get("aux_scale", 0) / t + tb.get("final_scale", 0) / t
    return per + stats["final_fraction"] * ELEM_BYTES[d["final"]] * hidden


def format_stats(s: dict) -> str:
    h, t = s["hidden"], s["tokens"]
    measured = s["file_bytes"] / t
    parts = " + ".join(f"{k} {b / t:,.1f}" for k, b in sorted(s["tensor_bytes"].items(), key=lambda kv: -kv[1]))
    header = measured - sum(s["tensor_bytes"].values()) / t
    bf16, specforge = 8 * h + 5, 8 * h + 16
    ours_kimi = bytes_per_token_at(s, KIMI_H)
    seeds_kimi = 4 * KIMI_H * 2
    return "\n".join([
        f"hidden shards  {s['dir']}: {s['samples']:,} samples, {t:,} tokens, {s['shards']} shards, "
        f"{s['file_bytes'] / 2**20:,.1f} MiB",
        f"storage        aux {s['dtypes']['aux']}, final {s['dtypes']['final']} on "
        f"{100 * s['final_fraction']:.1f}% of tokens, H = {h}",
        f"bytes/token    {measured:,.1f} = {parts} (+ headers {header:,.1f})",
        f"vs bf16 on every row    (8H+5  = {bf16:,} B/token): {measured / bf16:.3f}x",
        f"vs SpecForge            (8H+16 = {specforge:,} B/token): {measured / specforge:.3f}x",
        f"at Kimi-K2.5 (H={KIMI_H}): {ours_kimi / 1e3:,.1f} KB/token vs the seeds' {seeds_kimi / 1e3:,.1f} KB/token "
        f"({ours_kimi / seeds_kimi:.3f}x); their {KIMI_TOKENS / 1e6:.1f}M tokens: "
        f"{KIMI_TOKENS * ours_kimi / 2**30:,.0f} GiB instead of {KIMI_GIB} GiB",
    ])
