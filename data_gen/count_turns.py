"""How many conversations and user turns data_gen would regenerate from its prompts, per prompt limit.

    python -m data_gen.count_turns --config configs/smollm2-135m-instruct.yaml --max-prompt-tokens 1024,1536,2048 \\
        data_gen.max_turns=0 data_gen.max_context_tokens=4096 data_gen.max_new_tokens=1024

Why: choosing data_gen.max_prompt_tokens / max_context_tokens for a large run. data_gen skips a conversation
whose templated first turn exceeds max_prompt_tokens, and ends one at the first later turn whose templated
request (with the answers so far) exceeds max_context_tokens. The answers don't exist yet, so each later
turn is counted twice: with empty answers (an upper bound) and with every answer max_new_tokens long (a
floor). Requests are built by data_gen's own Regeneration and tokenized as data_gen does (core.target.chat).
Only the tokenizer of target.model is loaded.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from core.run.config import load_config
from core.target.chat import fitting_prompts, prompt_ids
from core.target.model import load_tokenizer
from core.target.prompts import Prompt, load_prompts
from data_gen.chat_tokenize import ThinkingStyle
from data_gen.conversation import regenerations, replay_turns
from data_gen.openai_client import Reply

EMPTY = Reply(content="", reasoning="", finish_reason="stop", completion_tokens=0)
NO_THINKING = ThinkingStyle(mode="drop", template_renders=False, prompt_opens=False)


def request_lengths(prompt: Prompt, tok, dg, stop_above: int) -> list[int]:
    """Token count of each request data_gen would send (answers left empty), until one exceeds stop_above."""
    conv, lengths = regenerations(prompt, dg.max_turns, 1, None)[0], []
    while (req := conv.next_request()) is not None and (not lengths or lengths[-1] <= stop_above):
        lengths.append(len(prompt_ids(tok, req, dg.chat_template_kwargs)))
        conv.add_reply(EMPTY, NO_THINKING)
    return lengths


def turns_kept(lengths: list[int], max_prompt: int, max_context: int, answer_tokens: int) -> int:
    """User turns answered: 0 if the first is too long, else up to the first later request past max_context."""
    if lengths[0] > max_prompt:
        return 0
    k = 1
    while k < len(lengths) and lengths[k] + k * answer_tokens <= max_context:
        k += 1
    return k


def user_turns(prompt: Prompt, max_turns: int) -> int:
    return sum(m["role"] == "user" for m in replay_turns(prompt, max_turns))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    ap.add_argument("--max-prompt-tokens", default=None,
                    help="comma list of values to count for (default: the config's data_gen.max_prompt_tokens)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data_gen.max_turns=0")
    args = ap.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    dg, tok, skipped = cfg.data_gen, load_tokenizer(cfg), Counter()
    prompts = load_prompts(dg.prompts, "train", dg.heldout_percent, dg.on_bad_record == "strict", skipped)
    limits = [int(v) for v in args.max_prompt_tokens.split(",")] if args.max_prompt_tokens else [dg.max_prompt_tokens]
    distinct = [p for p, _ in fitting_prompts(prompts, tok, max(limits), len(prompts), skipped, dg.max_turns)]
    counted = [(user_turns(p, dg.max_turns), request_lengths(p, tok, dg, dg.max_context_tokens)) for p in distinct]
    lines = [f"{dg.prompts}, train split (heldout_percent {dg.heldout_percent}), max_turns {dg.max_turns}: "
             f"{len(prompts):,} conversations, {sum(user_turns(p, dg.max_turns) for p in prompts):,} user turns; "
             f"passed over: {dict(skipped)} (prompt_too_long at {max(limits)})\n"
             f"max_context_tokens {dg.max_context_tokens}; answers counted as 0 or {dg.max_new_tokens} tokens\n"
             "| max_prompt_tokens | conversations | user turns | turns kept, empty answers "
             f"| turns kept, {dg.max_new_tokens}-token answers |\n|---|---|---|---|---|"]
    for limit in limits:
        fit = [(n, lengths) for n, lengths in counted if lengths[0] <= limit]
        kept = [sum(turns_kept(lengths, limit, dg.max_context_tokens, a) for _, lengths in fit)
                for a in (0, dg.max_new_tokens)]
        lines.append(f"| {limit} | {len(fit):,} | {sum(n for n, _ in fit):,} | {kept[0]:,} | {kept[1]:,} |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
