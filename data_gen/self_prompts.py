"""User turns the target writes itself (Magpie): a prompt source that needs no dataset.

Why: the drafter's τ grows with distinct prompts, not with tokens per answer (docs/PERFORMANCE.md), and the
packaged ShareGPT holds ~15k usable conversations. An instruct model's chat template cut right after its user
header is a prompt for a user turn: sampled at T~1, the target writes requests of its own, which data_gen then
answers like any other prompt (Magpie, Xu et al. 2024). The answers stay the target's own, at data_gen's
temperature; only the questions are new.

How: `data_gen.self_prompts=N` (hf backend: sampled in-process; openai: the header as a raw-text
`/v1/completions` prompt, which SGLang, vLLM and llama-server serve) adds N of them (ids self-<batch>-<row>)
after data_gen.prompts' conversations. They are kept in <run>/conversations/self_prompts.jsonl, rewritten atomically after each sampled batch, so a
killed run keeps the batches it finished and a rerun continues from the next; each batch draws from its own
seed, so what a rerun writes does not depend on where the kill came.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_text, read_jsonl
from core.target.prompts import Prompt

log = logging.getLogger("data_gen")
SENTINEL = "\x00EAGLE3_USER_TURN\x00"
MAX_TURN_TOKENS = 128  # a user turn the target has not ended by then is dropped (most end within 20-60)
MIN_WORDS = 3
MAX_BATCH_FACTOR = 4  # give up after 4x the batches that n prompts would need if every row were usable


def user_header(tok, template_kwargs: dict | None = None) -> str:
    """The chat template's text up to where a user turn's text starts (its default system turn included)."""
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                   add_generation_prompt=False, **(template_kwargs or {}))
    if text.count(SENTINEL) != 1:
        raise UserError("data_gen.self_prompts: the target's chat template does not render a user turn's text "
                        "verbatim, so there is no user header to sample from; use data_gen.self_prompts=0")
    return text[: text.index(SENTINEL)]


def usable_turn(text: str | None, special_tokens: set[str]) -> str | None:
    """The turn's text if it can be a prompt: ended by the target itself (None otherwise), at least MIN_WORDS
    words, no template markup inside."""
    if text is None:
        return None
    text = text.strip()
    if len(text.split()) < MIN_WORDS or any(s in text for s in special_tokens):
        return None
    return text


def self_prompts(path: Path, n: int, sample_batch: Callable[[int], list[str | None]], batch_size: int,
                 special_tokens: set[str]) -> list[Prompt]:
    """The first n usable, distinct user turns: those already in `path`, then batch after batch of
    `sample_batch(index)` (batch_size texts, None for a turn cut off by the length cap) until there are n."""
    rows = read_jsonl(path)
    seen = {_folded(r["prompt"]) for r in rows}
    index = 1 + max((r["batch"] for r in rows), default=-1)
    limit = index + MAX_BATCH_FACTOR * -(-n // batch_size)
    while len(rows) < n:
        if index >= limit:
            raise UserError(f"data_gen.self_prompts = {n}: the target wrote only {len(rows)} usable user turns in "
                            f"{index} batches of {batch_size} (the rest ran past {MAX_TURN_TOKENS} tokens, were "
                            f"shorter than {MIN_WORDS} words or repeated); lower data_gen.self_prompts or "
                            "data_gen.self_prompt_temperature")
        kept = 0
        for row, text in enumerate(sample_batch(index)):
            text = usable_turn(text, special_tokens)
            key = text and _folded(text)
            if key and key not in seen:
                seen.add(key)
                rows.append({"id": f"self-{index:05d}-{row:03d}", "batch": index, "prompt": text})
                kept += 1
        log.info("self prompts: batch %d kept %d of %d (%d of %d)", index, kept, batch_size, min(len(rows), n), n)
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        index += 1
    return [Prompt(r["id"], [{"role": "user", "content": r["prompt"]}]) for r in rows[:n]]


def _folded(text: str) -> str:
    """What makes two turns the same prompt: case and runs of whitespace do not count."""
    return " ".join(text.casefold().split())
