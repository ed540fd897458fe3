"""Regenerate real conversations with the target itself (on-policy data).

    python -m data_gen --config configs/smollm2-135m-instruct.yaml                  # in-process (hf)
    python -m data_gen data_gen.backend=openai data_gen.base_url=http://127.0.0.1:30000/v1 \\
        data_gen.max_turns=0 data_gen.concurrency=64                               # any OpenAI server
    python -m data_gen --config configs/smollm2-135m-instruct.yaml data_gen.backend=dataset  # the source's answers
    python -m data_gen --config configs/smollm2-135m-instruct.yaml data_gen.self_prompts=2000  # + its own questions

Output: <run>/conversations/part-*.parquet (core/storage/conversations.py), summary.json, manifest.json.
Rerunning resumes: conversations already in a committed part are skipped, nothing is written twice;
conversations that failed (retries exhausted) are retried, and the run exits non-zero until none fail.
SIGTERM (`timeout`, a scheduler's notice) stops the `hf` backend after the call in flight, with every
finished conversation committed, and exits non-zero; kill -9 keeps the parts committed before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from core.engine.decode import DecodeRun
from core.engine.decode_step import FUSE_MODES
from core.run.config import RunConfig
from core.run.errors import UserError
from core.run.stop_signal import sigterm_requests_stop
from core.storage.atomic_io import atomic_write_json, remove_partial_writes
from core.storage.conversations import done_ids, template_hash, write_part
from core.storage.manifest import IN_PROGRESS, open_stage_dir, write_manifest
from core.storage.stage_lock import stage_lock
from core.target.chat import fitting_prompts
from core.target.model import end_of_turn_ids, load_target, load_tokenizer, resolve_precision, resolve_target
from core.target.prompts import SPLIT_RULE, load_prompts
from data_gen.batch_pool import answer_parts
from data_gen.chat_tokenize import TemplateError, thinking_style, tokenize_conversation
from data_gen.conversation import Regeneration, regenerations, request_ids, to_rows
from data_gen.dataset_backend import check_answers, run_dataset
from data_gen.hf_backend import HFBackend
from data_gen.openai_backend import openai_user_turns, run_openai
from data_gen.openai_client import Reply
from data_gen.self_prompts import MAX_TURN_TOKENS, self_prompts, user_header

log = logging.getLogger("data_gen")
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}]


def check_options(cfg: RunConfig) -> None:
    dg = cfg.data_gen
    if dg.backend == "openai" and not dg.base_url:
        raise UserError("data_gen.base_url is empty: set it to the server's /v1 root, "
                         "e.g. data_gen.base_url=http://127.0.0.1:30000/v1")
    if dg.n < 1 or dg.max_turns < 0:
        raise UserError(f"data_gen.n must be >= 1 and data_gen.max_turns >= 0 (got {dg.n}, {dg.max_turns})")
    if dg.self_prompts and dg.backend == "dataset":
        raise UserError(f"data_gen.self_prompts = {dg.self_prompts} with data_gen.backend = dataset: a dataset has no "
                        "answers to questions the target wrote; use backend hf or openai")
    if dg.backend == "dataset" and dg.n != 1:
        raise UserError(f"data_gen.n = {dg.n} with data_gen.backend = dataset: the source has one answer per turn, "
                        "use data_gen.n=1")


def decode_options(dg, device: torch.device) -> tuple[bool, str]:
    """data_gen.compile -> (replay the hf backend's decode steps as CUDA graphs, how torch.compile fuses them:
    "" = not compiled, "fused" or "exact"; core/engine/decode_step.py)."""
    if dg.compile == "yes" and device.type != "cuda":
        raise UserError(f"data_gen.compile = yes needs a CUDA target device (CUDA graphs), not {device}: "
                        "use data_gen.compile=auto or no")
    fuse = dg.compile if dg.compile in FUSE_MODES else ""
    graphs = device.type == "cuda" if dg.compile == "auto" or fuse else dg.compile == "yes"
    return graphs, fuse


def end_of_turn_strings(cfg: RunConfig, tok, generation_config) -> list[str]:
    if cfg.data_gen.end_of_turn:
        return list(cfg.data_gen.end_of_turn)
    return [tok.convert_ids_to_tokens(i) for i in end_of_turn_ids(tok, generation_config)]


class PartSink:
    """Collects finished conversations; commits a parquet part every `part_samples` rows, and counts."""

    def __init__(self, out: Path, part_samples: int, to_rows, drop_truncated: bool):
        self.out, self.part_samples, self.to_rows, self.drop_truncated = out, part_samples, to_rows, drop_truncated
        self.rows: list[dict] = []
        self.stats: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()

    def add(self, conv: Regeneration) -> None:
        if conv.answered == 0:
            self.skipped["no_answer"] += 1
            return
        if self.drop_truncated and any(conv.truncated):
            self.skipped["truncated_dropped"] += 1
            return
        try:
            rows = self.to_rows(conv)
        except TemplateError as e:
            self.skipped["template_mismatch"] += 1
            log.warning("conversation %s skipped: %s", conv.id, e)
            return
        self.stats.update(conversations=1, samples=len(rows), turns=conv.answered, truncated=any(conv.truncated),
                          tokens=sum(len(r["input_ids"]) for r in rows), loss_tokens=sum(sum(r["loss_mask"]) for r in rows))
        self.stats[f"ended_by_{conv.ended_by}"] += 1
        self.rows += rows
        if len(self.rows) >= self.part_samples:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            write_part(self.out, self.rows)
            self.rows = []


def run_hf(todo: list[Regeneration], backend: HFBackend, tok, cfg: RunConfig, sink: PartSink, bar) -> bool:
    """Full batches from one pool of requests across parts (data_gen/batch_pool.py); parts commit in order.
    SIGTERM stops it after the call in flight, with every finished conversation committed -> False."""
    dg, thinking = cfg.data_gen, thinking_style(tok, cfg.data_gen.reasoning, cfg.data_gen.chat_template_kwargs)

    def advance(conv: Regeneration, reply: Reply | None) -> list[int] | None:
        if reply is not None:
            conv.add_reply(reply, thinking)
        ids = request_ids(conv, tok, dg)
        if ids is None:
            bar.update(1)
        return ids

    def commit(part: list[Regeneration]) -> None:
        for conv in part:
            sink.add(conv)
        sink.flush()
        bar.set_postfix(samples=sink.stats["samples"], tokens=sink.stats["tokens"])

    parts = [todo[s:s + dg.part_samples] for s in range(0, len(todo), dg.part_samples)]
    with sigterm_requests_stop() as stop:
        return answer_parts(parts, dg.batch_size, advance, backend.answer, commit, stop.is_set)


def target_written_prompts(cfg: RunConfig, tok, out: Path, backend: HFBackend | None):
    """data_gen.self_prompts user turns (data_gen/self_prompts.py), sampled by the in-process target (backend) or
    by the server (openai), batch after batch, kept in out/self_prompts.jsonl."""
    dg = cfg.data_gen
    header = user_header(tok, dg.chat_template_kwargs)
    ids, rows = tok(header, add_special_tokens=False)["input_ids"], dg.batch_size if backend else dg.concurrency

    def sample(i: int) -> list[str | None]:
        if backend:
            return backend.user_turns(ids, rows, MAX_TURN_TOKENS, dg.self_prompt_temperature, cfg.seed * 1_000_003 + i)
        return openai_user_turns(cfg, header, i)
    return self_prompts(out / "self_prompts.jsonl", dg.self_prompts, sample, rows, set(tok.get_added_vocab()))


SETTINGS_KEYS = ("backend", "model_name", "prompts", "heldout_percent", "max_turns", "n", "reasoning", "end_of_turn",
                 "chat_template_kwargs", "max_prompt_tokens", "max_context_tokens", "max_new_tokens", "drop_truncated",
                 "temperature", "top_p", "stop", "request_seed")


def generation_settings(cfg: RunConfig, template_hash: str) -> dict:
    """What shapes a conversation (not how fast it is made, nor how many): a rerun adds to or resumes
    an output dir only when these are the same, so one dir never mixes two targets or two settings."""
    own = {"data_gen.self_prompt_temperature": cfg.data_gen.self_prompt_temperature} if cfg.data_gen.self_prompts else {}
    return {"target.model": cfg.target.model, "target.dtype": cfg.target.dtype, "seed": cfg.seed,
            "chat_template_sha256": template_hash, "split": SPLIT_RULE,
            **{f"data_gen.{k}": getattr(cfg.data_gen, k) for k in SETTINGS_KEYS},
            **own}


def main(cfg: RunConfig, fresh: bool = False) -> Path:
    check_options(cfg)
    out = cfg.run_path / "conversations"
    with stage_lock(out, "data_gen"):
        return generate(cfg, out, fresh)


def open_backend(cfg: RunConfig) -> tuple:
    """(tokenizer, end-of-turn strings, HFBackend or None): the in-process target for the hf backend, else only
    the tokenizer and generation config. A template we can't segment fails here, before any request is sent."""
    dg = cfg.data_gen
    if dg.backend == "hf":
        model, tok = load_target(cfg)
        gen_cfg = model.generation_config
    else:
        from transformers import GenerationConfig
        tok = load_tokenizer(cfg)
        try:
            gen_cfg = GenerationConfig.from_pretrained(resolve_target(cfg), local_files_only=True)
        except OSError:
            gen_cfg = None
    eot = end_of_turn_strings(cfg, tok, gen_cfg)
    try:
        tokenize_conversation(tok, PROBE, eot, [False] * 4, dg.chat_template_kwargs, dg.reasoning == "render")
    except TemplateError as e:
        raise UserError(f"target {cfg.target.model}: {e}") from None
    if dg.backend != "hf":
        return tok, eot, None
    stop = sorted(set(end_of_turn_ids(tok, gen_cfg)) | set(tok.convert_tokens_to_ids(eot)))
    graphs, fuse = decode_options(dg, model.device)
    log.info("hf backend on %s: decode steps %s%s", model.device, "as CUDA graphs" if graphs else "eager",
             f", fused by torch.compile ({fuse})" if fuse else "")
    run = DecodeRun(bf16_prefill=resolve_precision(dg.mixed_precision) == "bf16", graphs=graphs, fuse=fuse)
    return tok, eot, HFBackend(model, tok, stop, dg.max_new_tokens, dg.temperature, cfg.seed, run)


def regenerate(dg, chosen) -> list[Regeneration]:
    """The conversations to regenerate from (prompt, ids) pairs; similar lengths batch together."""
    return [c for p, ids in sorted(chosen, key=lambda x: len(x[1]))
            for c in regenerations(p, dg.max_turns, dg.n, dg.request_seed)]


def run_backend(cfg: RunConfig, todo: list[Regeneration], tok, backend: HFBackend | None, sink, bar) -> tuple:
    """Every conversation in `todo` through the configured backend -> (completed, failures by kind); whatever
    finished is committed, even when the run is stopped by an error."""
    dg, failed, completed = cfg.data_gen, Counter(), True
    thinking = thinking_style(tok, dg.reasoning, dg.chat_template_kwargs)
    try:
        if dg.backend == "hf":
            completed = run_hf(todo, backend, tok, cfg, sink, bar)
        elif dg.backend == "dataset":
            run_dataset(todo, tok, dg, thinking, sink, bar)
        else:
            failed = asyncio.run(run_openai(todo, tok, cfg, sink, bar, thinking))
    finally:
        sink.flush()
        bar.close()
    return completed, failed


def run_summary(sink, selected: int, skipped: Counter, failed: Counter, wall: float, total: int, completed: bool,
                backend: str) -> dict:
    """summary.json: this run's counts (conversations, samples, tokens, truncation, skips, errors) and the total."""
    s = sink.stats
    return {"backend": backend, "selected": selected, "generated_now": s["conversations"],
            "samples_now": s["samples"], "tokens_now": s["tokens"], "loss_tokens_now": s["loss_tokens"],
            "assistant_turns_now": s["turns"],
            "truncation_rate_now": round(s["truncated"] / max(1, s["conversations"]), 4),
            "ended_by_now": {k.removeprefix("ended_by_"): v for k, v in s.items() if k.startswith("ended_by_")},
            "input_skipped": dict(skipped), "output_skipped_now": dict(sink.skipped),
            "errors_now": dict(failed), "wall_s": round(wall, 1),
            "conversations_total": total, **({} if completed else {"stopped_by": "SIGTERM"})}


def generate(cfg: RunConfig, out: Path, fresh: bool) -> Path:
    dg = cfg.data_gen
    torch.manual_seed(cfg.seed)
    tok, eot, backend = open_backend(cfg)
    thash = template_hash(tok.chat_template)
    skipped: Counter[str] = Counter()
    prompts = load_prompts(dg.prompts, "train", dg.heldout_percent, dg.on_bad_record == "strict", skipped)
    chosen = fitting_prompts(prompts, tok, dg.max_prompt_tokens, dg.num_samples, skipped, dg.max_turns)
    convs = regenerate(dg, chosen)
    if not convs:
        raise UserError(f"data_gen.prompts = {dg.prompts!r}: no prompt is left to generate from (skipped: "
                        f"{dict(skipped)}); check the file or raise data_gen.max_prompt_tokens")
    if dg.backend == "dataset":
        check_answers(convs, dg.prompts)
    settings = generation_settings(cfg, thash)  # checked before any "done" id is skipped
    open_stage_dir(out, "data_gen", settings, fresh)
    compat = {"target": cfg.target.model, "template_hash": thash}
    write_manifest(out, "data_gen", cfg, compat, {"status": IN_PROGRESS}, {"prompts": dg.prompts}, settings)
    if n := remove_partial_writes(out):
        log.info("removed %d part files cut short by a kill (their conversations are redone)", n)
    if dg.self_prompts:
        own = target_written_prompts(cfg, tok, out, backend)
        convs = regenerate(dg, chosen + fitting_prompts(own, tok, dg.max_prompt_tokens, dg.self_prompts, skipped,
                                                        dg.max_turns))
    done = done_ids(out)
    todo = [c for c in convs if c.id not in done]
    log.info("%d conversations selected (input skipped: %s), %d already done, %d to generate",
             len(convs), dict(skipped), len(convs) - len(todo), len(todo))
    sink = PartSink(out, dg.part_samples, lambda c: to_rows(c, tok, eot, dg.reasoning, dg.chat_template_kwargs,
                                                            cfg.target.model, thash), dg.drop_truncated)
    bar = tqdm(total=len(todo), desc="generate", unit="conv", smoothing=0.05)
    t0 = time.time()
    completed, failed = run_backend(cfg, todo, tok, backend, sink, bar)
    summary = run_summary(sink, len(convs), skipped, failed, time.time() - t0, len(done_ids(out)), completed,
                          dg.backend)
    atomic_write_json(out / "summary.json", summary)
    write_manifest(out, "data_gen", cfg, compat, summary, {"prompts": dg.prompts}, settings)
    log.info("conversations in %s: %s", out, summary)
    if not completed:
        raise UserError(f"stopped by SIGTERM: {summary['conversations_total']} conversations committed (every one finished "
                        "by then); rerun the same command to continue")
    lost = failed["retries_exhausted"]
    if lost:
        raise UserError(f"{lost} conversations failed after {dg.max_retries} retries (errors: {dict(failed)}); "
                         "everything else is committed: rerun the same command to retry them")
    return out
