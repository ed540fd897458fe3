"""Extract hidden states for every conversation, resumably.

    python -m extract --config configs/smollm2-135m-instruct.yaml

Reads <run>/conversations, writes <run>/hidden (core/hidden_shards.py) + manifest.json.
A rerun skips ids already in the shard index; a kill -9 loses at most the uncommitted shard.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from core.aux_layers import resolve_aux_layers
from core.config import RunConfig
from core.conversations import read_conversations
from core.hidden_shards import ShardWriter
from core.manifest import check_compat, read_manifest, write_manifest
from core.target import load_target, resolve_precision, target_info
from extract.hf_engine import batches_by_tokens, extract_batch

log = logging.getLogger("extract")


def main(cfg: RunConfig) -> Path:
    ex = cfg.extract
    if ex.engine != "hf":
        raise ValueError(f"extract.engine = {ex.engine!r}: only 'hf' exists so far")
    conv_dir, out = cfg.run_path / "conversations", cfg.run_path / "hidden"
    check_compat(read_manifest(conv_dir, "generate"), {"target": cfg.target.model}, conv_dir)
    info = target_info(cfg)
    aux_layers = resolve_aux_layers(ex.aux_layers, info.num_layers)
    compat = {"target": cfg.target.model, "hidden_size": info.hidden_size, "aux_layers": aux_layers,
              "vocab_size": info.vocab_size, "dtype": ex.dtype}
    if (out / "manifest.json").exists():
        check_compat(read_manifest(out, "extract"), compat, out)
    write_manifest(out, "extract", cfg, compat, {"status": "in progress"})

    convs = read_conversations(conv_dir)
    writer = ShardWriter(out, info.hidden_size, ex.dtype, ex.shard_mb)
    todo = [i for i, sid in enumerate(convs["id"]) if sid not in writer.done]
    rows = convs.select(todo)
    log.info("%d conversations, %d already extracted, %d to do; aux layers %s",
             len(convs), len(convs) - len(todo), len(todo), aux_layers)
    model, _ = load_target(cfg)
    precision = resolve_precision(ex.mixed_precision)
    lengths = [len(x) for x in rows["input_ids"]]
    bar = tqdm(total=sum(lengths), desc="extract", unit="tok", unit_scale=True)
    with writer:
        for batch in batches_by_tokens(lengths, ex.batch_tokens):
            sel = rows.select(batch)
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                outs = extract_batch(model, sel["input_ids"], aux_layers)
            for sid, ids, mask, (aux, final) in zip(sel["id"], sel["input_ids"], sel["loss_mask"], outs, strict=True):
                writer.add(sid, ids, mask, aux, final)
            bar.update(sum(lengths[i] for i in batch))
    bar.close()
    counts = {"samples": len(writer.done), "extracted_now": len(todo)}
    write_manifest(out, "extract", cfg, compat, counts, {"conversations": str(conv_dir)})
    log.info("hidden shards in %s: %s", out, counts)
    return out
