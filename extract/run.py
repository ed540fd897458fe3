"""Extract hidden states for every conversation, resumably.

    python -m extract --config configs/smollm2-135m-instruct.yaml                       # in-process (hf)
    python -m extract --config ... --engine sglang --server http://127.0.0.1:30000   # extract.engine, server_url
    python -m extract --config ... --engine vllm --server http://127.0.0.1:8000      # stock vLLM, no patch

Reads <run>/conversations, writes <run>/hidden (core/storage/hidden_shards.py) + manifest.json.
A rerun skips ids already in the shard index; a kill -9 loses at most the uncommitted shard.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tqdm import tqdm

from core.run.config import RunConfig
from core.run.errors import UserError
from core.storage.conversations import read_conversations_for
from core.storage.hidden_shards import ShardWriter
from core.storage.manifest import IN_PROGRESS, open_stage_dir, write_manifest
from core.storage.stage_lock import stage_lock, stage_reader
from core.target.aux_layers import resolve_aux_layers
from core.target.hidden_capture import capture_compat, extract_batch
from core.target.model import load_final_norm, load_target, resolve_precision, target_info
from core.target.vllm_extract import vllm_layer_ids
from extract.hf_engine import batches_by_tokens
from extract.server_extract import ServerExtractor
from extract.sglang_client import SGLangExtractor
from extract.vllm_client import VLLMExtractor

log = logging.getLogger("extract")


def main(cfg: RunConfig, fresh: bool = False) -> Path:
    out = cfg.run_path / "hidden"
    with stage_reader(cfg.run_path / "conversations", "extract"), stage_lock(out, "extract"):
        return extract(cfg, out, fresh)


def extract(cfg: RunConfig, out: Path, fresh: bool) -> Path:
    ex, conv_dir = cfg.extract, cfg.run_path / "conversations"
    conv_manifest, convs = read_conversations_for(conv_dir, cfg.target.model)
    info = target_info(cfg)
    aux_layers = resolve_aux_layers(ex.aux_layers, info.num_layers)
    compat = {**capture_compat(cfg, info, aux_layers), "dtype": ex.dtype, "spans": ex.spans}
    # the conversations' own settings, not their count: more conversations of the same settings extend the shards
    settings = {"conversations": conv_manifest.get("fingerprint"), "target.dtype": cfg.target.dtype, **compat}
    open_stage_dir(out, "extract", settings, fresh)
    write_manifest(out, "extract", cfg, compat, {"status": IN_PROGRESS}, {"conversations": str(conv_dir)}, settings)

    writer = ShardWriter(out, info.hidden_size, ex.dtype, ex.shard_mb, ex.spans)
    todo = [i for i, sid in enumerate(convs["id"]) if sid not in writer.done]
    rows = convs.select(todo)
    log.info("%d conversations, %d already extracted, %d to do; aux layers %s",
             len(convs), len(convs) - len(todo), len(todo), aux_layers)
    lengths = [len(x) for x in rows["input_ids"]]
    bar = tqdm(total=sum(lengths), desc="extract", unit="tok", unit_scale=True)
    failures = {}
    with writer:
        if ex.engine == "hf":
            model, _ = load_target(cfg)
            extract_hf(model, rows, lengths, aux_layers, writer, bar, ex.batch_tokens,
                       resolve_precision(ex.mixed_precision))
        else:
            failures = extract_server(cfg, server_client(cfg, info, aux_layers), rows, writer, bar)
    bar.close()
    counts = {"samples": len(writer.done), "extracted_now": len(todo) - sum(failures.values()),
              "failed_now": failures}
    write_manifest(out, "extract", cfg, compat, counts, {"conversations": str(conv_dir)}, settings)
    log.info("hidden shards in %s: %s", out, counts)
    if failures:
        raise UserError(f"{sum(failures.values())} samples failed their checks ({failures}); the rest is "
                         "committed and nothing wrong was written: rerun to retry them")
    return out


def extract_hf(model, rows, lengths: list[int], aux_layers: list[int], writer: ShardWriter, bar, batch_tokens: int,
               precision: str) -> None:
    """rows: a conversations Dataset (id, input_ids, loss_mask); batches of <= batch_tokens padded tokens."""
    for batch in batches_by_tokens(lengths, batch_tokens):
        sel = rows.select(batch)
        outs = extract_batch(model, sel["input_ids"], aux_layers, precision)
        for sid, ids, mask, (seen, aux, final) in zip(sel["id"], sel["input_ids"], sel["loss_mask"], outs, strict=True):
            writer.add(sid, ids, mask, aux, final, seen_ids=seen)
        bar.update(sum(lengths[i] for i in batch))


def server_client(cfg: RunConfig, info, aux_layers: list[int]) -> ServerExtractor:
    """The client of extract.engine's server (sglang: our plugin's dumps; vllm: its hidden-states connector)."""
    ex = cfg.extract
    args = (ex.server_url, Path(ex.dump_dir or cfg.run_path / "dumps").resolve(), ex.max_inflight,
            ex.dump_budget_mb * 2**20, ex.request_timeout)
    if ex.engine == "sglang":
        return SGLangExtractor(*args, dump_timeout=ex.request_timeout)
    weight, eps = load_final_norm(cfg)
    return VLLMExtractor(*args, dump_timeout=ex.request_timeout, layer_ids=vllm_layer_ids(aux_layers, info.num_layers),
                         hidden_size=info.hidden_size, norm_weight=weight, norm_eps=eps)


def extract_server(cfg: RunConfig, client: ServerExtractor, rows, writer: ShardWriter, bar) -> dict:
    if n := client.clear_stale_dumps():
        log.info("removed %d dumps left by an interrupted run (their samples are redone)", n)

    def on_result(sid, sample, seen_ids, aux, final):
        ids, mask = sample
        writer.add(sid, ids, mask, aux, final, seen_ids=seen_ids)
        bar.update(len(ids))

    samples = ((sid, ids, (ids, mask)) for sid, ids, mask in zip(rows["id"], rows["input_ids"], rows["loss_mask"],
                                                                  strict=True))
    asyncio.run(client.run(samples, on_result))
    if client.paused_s:
        log.info("paused %.1f s in total for the dump-dir budget", client.paused_s)
    return dict(client.failures)
