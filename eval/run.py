"""Measure speculative decoding with a drafter against the plain target (greedy, batch 1).

    python -m eval --config configs/smollm2-135m-instruct.yaml
    python -m eval --prompts ../shared/data/mt_bench/question.jsonl --draft runs/x/drafter --out /tmp/mt

Per prompt: baseline greedy decode and chain speculative decode (K = eval.draft_steps drafts per
target verification), both timed after a warm-up, outputs compared token for token.
Writes report.json, report.md and PNG plots to <run>/eval (or --out).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from core.chat import fitting_prompts
from core.config import RunConfig
from core.decode import generate, speculative_generate
from core.drafter import Eagle3Drafter
from core.prompts import load_prompt_file, load_prompts
from core.target import end_of_turn_ids, load_target, load_target_embeddings, target_info
from eval.report import summarize, write_report

log = logging.getLogger("eval")


def add_eval_args(p) -> None:
    p.add_argument("--prompts", default=None, help="jsonl/json prompt file (MT-Bench, {prompt}, ShareGPT)")
    p.add_argument("--draft", default=None, help="SGLang-format drafter dir (default <run>/drafter)")
    p.add_argument("--out", default=None, help="report dir (default <run>/eval)")
    p.add_argument("--max-prompts", type=int, default=None, help="overrides eval.max_prompts")
    p.add_argument("--max-new-tokens", type=int, default=None, help="overrides eval.max_new_tokens")


def eval_prompts(cfg: RunConfig, tokenizer, prompt_file: str | None) -> list[tuple[str, list[int]]]:
    if prompt_file:
        prompts = load_prompt_file(Path(prompt_file))
    elif cfg.eval.prompts == "heldout":
        prompts = load_prompts(cfg.data_gen.prompts, "heldout", cfg.data_gen.heldout_percent)
    else:
        prompts = load_prompt_file(Path(cfg.eval.prompts))
    out = [(p.id, ids) for p, ids in fitting_prompts(prompts, tokenizer, cfg.data_gen.max_prompt_tokens,
                                                     cfg.eval.max_prompts, Counter())]
    if not out:
        raise ValueError(f"no eval prompts of <= {cfg.data_gen.max_prompt_tokens} tokens in "
                         f"{prompt_file or cfg.eval.prompts}")
    return out


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main(cfg: RunConfig, prompts: str | None = None, draft: str | None = None, out: str | None = None,
         max_prompts: int | None = None, max_new_tokens: int | None = None) -> dict:
    ev = cfg.eval
    ev.max_prompts = max_prompts or ev.max_prompts
    ev.max_new_tokens = max_new_tokens or ev.max_new_tokens
    draft_dir = Path(draft) if draft else cfg.run_path / "drafter"
    out_dir = Path(out) if out else cfg.run_path / "eval"
    model, tok = load_target(cfg)
    info = target_info(cfg)
    drafter = Eagle3Drafter.from_pretrained(draft_dir, load_target_embeddings(cfg).embed, info.model_type,
                                            info.num_layers).to(model.device, model.dtype).eval()
    stop = end_of_turn_ids(tok, model.generation_config)
    items = eval_prompts(cfg, tok, prompts)
    k, n = ev.draft_steps, ev.max_new_tokens
    # warm-up (allocator, kernels) kept out of the timings
    generate(model, [items[0][1]], 4, stop)
    speculative_generate(model, drafter, items[0][1], 4, stop, k)
    results = []
    for pid, ids in tqdm(items, desc="eval", unit="prompt"):
        base, t_base = _timed(lambda ids=ids: generate(model, [ids], n, stop)[0])
        spec, t_spec = _timed(lambda ids=ids: speculative_generate(model, drafter, ids, n, stop, k))
        results.append({"id": pid, "prompt_tokens": len(ids), "tokens": len(spec.tokens),
                        "match": base.tokens == spec.tokens, "accept_lengths": spec.accept_lengths,
                        "time_baseline_s": t_base, "time_spec_s": t_spec, "baseline_tokens": len(base.tokens)})
    report = summarize(results, k)
    report.update({"target": cfg.target.model, "drafter": str(draft_dir), "device": str(model.device),
                   "prompts": prompts or ev.prompts, "max_new_tokens": n})
    write_report(out_dir, report, results)
    log.info("acceptance length %.3f at K=%d, speedup %.2fx, outputs match baseline: %s; report in %s",
             report["acceptance_length"], k, report["speedup"], report["outputs_match_baseline"], out_dir)
    return report
