"""Chat-template rendering shared by data_gen (prompts to answer), eval and train's τ probe (prompts to decode)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from core.run.errors import UserError
from core.target.prompts import Prompt, load_prompt_file, load_prompts


def prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` rendered with the target's template, ending in the assistant header."""
    return prompts_ids(tokenizer, [messages], template_kwargs)[0]


def prompts_ids(tokenizer, requests: list[list[dict]], template_kwargs: dict | None = None) -> list[list[int]]:
    """prompt_ids of many requests, tokenized as one batch (the fast tokenizer spreads it over threads)."""
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
             for m in requests]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def fitting_prompts(prompts: Iterable[Prompt], tokenizer, max_tokens: int, limit: int,
                    skipped: Counter, max_turns: int = 1) -> list[tuple[Prompt, list[int]]]:
    """The first `limit` prompts whose templated first user turn fits max_tokens, each distinct
    conversation once (first turn's token ids + the later user turns replayed, up to max_turns; 0 =
    all); what is passed over is counted in `skipped` by reason."""
    chosen, seen = [], set()
    for p in prompts:
        ids = prompt_ids(tokenizer, p.first_user_turn)
        later = [m["content"] for m in p.messages[len(p.first_user_turn):] if m["role"] == "user"]
        later = later[:max_turns - 1] if max_turns else later
        key = hashlib.sha256(repr((ids, later)).encode()).hexdigest()
        if len(ids) > max_tokens:
            skipped["prompt_too_long"] += 1
        elif key in seen:
            skipped["duplicate_prompt"] += 1
        else:
            seen.add(key)
            chosen.append((p, ids))
            if len(chosen) == limit:
                break
    return chosen


def eval_prompt_ids(cfg, tokenizer, prompt_file: str | None = None, limit: int | None = None) -> list[tuple[str, list[int]]]:
    """(id, templated prompt ids) of eval's prompts: --prompts, else eval.prompts, each held-out ShareGPT
    ("heldout") or a file; the first `limit` (default eval.max_prompts) that fit data_gen.max_prompt_tokens.
    Eval and train's τ probe measure on these."""
    source = prompt_file or cfg.eval.prompts
    if source == "heldout":
        prompts = load_prompts(cfg.data_gen.prompts, "heldout", cfg.data_gen.heldout_percent)
    else:
        prompts = load_prompt_file(Path(source))
    out = [(p.id, ids) for p, ids in fitting_prompts(prompts, tokenizer, cfg.data_gen.max_prompt_tokens,
                                                     limit or cfg.eval.max_prompts, Counter())]
    if not out:
        raise UserError(f"no eval prompts of <= {cfg.data_gen.max_prompt_tokens} tokens in "
                         f"{prompt_file or cfg.eval.prompts}")
    return out
