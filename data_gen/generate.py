"""Regenerate answers to real prompts with the target itself (on-policy data), in-process (`hf`).

    python -m data_gen --config configs/smollm2-135m-instruct.yaml

Output: <run>/conversations/part-*.parquet (see core/conversations.py), summary.json, manifest.json.
Rerunning resumes: ids already in a committed part are skipped, nothing is written twice.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from core.atomic_io import atomic_write_json
from core.chat import fitting_prompts
from core.config import RunConfig
from core.conversations import done_ids, template_hash, write_part
from core.decode import generate
from core.manifest import write_manifest
from core.prompts import Prompt, load_prompts
from core.target import end_of_turn_ids, load_target

log = logging.getLogger("data_gen")


def select_prompts(cfg: RunConfig, tokenizer) -> tuple[list[tuple[Prompt, list[int]]], Counter]:
    """The first num_samples train prompts that fit max_prompt_tokens, deduplicated by token ids."""
    dg, skipped = cfg.data_gen, Counter()
    prompts = load_prompts(dg.prompts, "train", dg.heldout_percent)
    return fitting_prompts(prompts, tokenizer, dg.max_prompt_tokens, dg.num_samples, skipped), skipped


def to_row(p: Prompt, ids: list[int], gen, tokenizer, model_id: str, thash: str) -> dict:
    answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
    return {"id": p.id, "messages": p.first_user_turn + [{"role": "assistant", "content": answer}],
            "input_ids": ids + gen.tokens, "loss_mask": [0] * len(ids) + [1] * len(gen.tokens),
            "finish_reason": gen.finish_reason, "template_hash": thash, "model_id": model_id}


def main(cfg: RunConfig) -> Path:
    dg = cfg.data_gen
    if dg.backend != "hf":
        raise ValueError(f"data_gen.backend = {dg.backend!r}: only 'hf' exists so far")
    out = cfg.run_path / "conversations"
    torch.manual_seed(cfg.seed)
    model, tok = load_target(cfg)
    chosen, skipped = select_prompts(cfg, tok)
    done = done_ids(out)
    todo = sorted(((p, ids) for p, ids in chosen if p.id not in done), key=lambda x: len(x[1]))  # less padding
    log.info("%d prompts selected (%s skipped), %d already done, %d to generate",
             len(chosen), dict(skipped), len(chosen) - len(todo), len(todo))
    stop, thash = end_of_turn_ids(tok, model.generation_config), template_hash(tok.chat_template)
    gen_rng = torch.Generator(device=model.device).manual_seed(cfg.seed)
    finish = Counter()
    bar = tqdm(total=len(todo), desc="generate", unit="sample")
    for start in range(0, len(todo), dg.part_samples):
        part = todo[start:start + dg.part_samples]
        rows = []
        for b in range(0, len(part), dg.batch_size):
            batch = part[b:b + dg.batch_size]
            gens = generate(model, [ids for _, ids in batch], dg.max_new_tokens, stop, dg.temperature, gen_rng)
            rows += [to_row(p, ids, g, tok, cfg.target.model, thash) for (p, ids), g in zip(batch, gens, strict=True)]
            finish.update(g.finish_reason for g in gens)
            bar.update(len(batch))
            bar.set_postfix(tokens=sum(len(r["input_ids"]) for r in rows))
        write_part(out, rows)
    bar.close()
    summary = {"selected": len(chosen), "generated_now": len(todo), "skipped": dict(skipped),
               "finish_reason_now": dict(finish), "samples_total": len(done_ids(out))}
    atomic_write_json(out / "summary.json", summary)
    write_manifest(out, "data_gen", cfg, {"target": cfg.target.model, "template_hash": thash},
                   summary, {"prompts": dg.prompts})
    log.info("conversations in %s: %s", out, summary)
    return out
