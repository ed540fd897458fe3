"""`dataset` backend: keep the source's own assistant turns as the answers; nothing is generated.

    python -m data_gen --config configs/<name>.yaml data_gen.backend=dataset data_gen.max_turns=0

Why: regenerating every answer with the target is data_gen's slow stage, and the EAGLE papers and
SpecForge also train on a dataset's own answers; the teacher is still the target, since train labels
each position with the target's argmax. Everything else is the regenerating run's: the same prompts and
held-out split, turns, context cut, tokenization and loss mask, parts and resume. Only the tokenizer is
loaded. An answer longer than max_new_tokens is cut there and flagged finish_reason=length, as a capped
generation would be; a conversation ends before a kept user turn the source did not answer.
"""

from __future__ import annotations

from core.run.errors import UserError
from core.target.chat import prompts_ids
from data_gen.chat_tokenize import ThinkingStyle
from data_gen.conversation import Regeneration
from data_gen.openai_client import Reply

CHUNK = 256  # conversations in step: large batches for the tokenizer, few rows held before their part commits


def check_answers(convs: list[Regeneration], prompts: str) -> None:
    """Fail before any output when not one selected conversation has an answer to its first turn."""
    if not any(c.answers and c.answers[0] for c in convs):
        raise UserError(f"data_gen.prompts = {prompts!r} holds no assistant answers to keep (data_gen.backend = "
                        "dataset): use prompts with answers (ShareGPT format) or data_gen.backend=hf")


class SourceAnswers:
    def __init__(self, tokenizer, max_new_tokens: int):
        self.tok, self.max_new_tokens = tokenizer, max_new_tokens

    def replies(self, convs: list[Regeneration]) -> list[Reply | None]:
        """The source's answer to each conversation's pending user turn, as a server's reply (None where it
        has none); the answers are tokenized as one batch."""
        sources = [c.answers[c.answered] for c in convs]
        texts = [s["content"] for s in sources if s is not None]
        ids = iter(self.tok(texts, add_special_tokens=False)["input_ids"] if texts else [])
        return [None if s is None else self.reply(s, next(ids)) for s in sources]

    def reply(self, source: dict, ids: list[int]) -> Reply:
        text, reasoning = source["content"], source.get("reasoning_content", "")
        if len(ids) <= self.max_new_tokens:
            return Reply(text, reasoning, "stop", len(ids))
        n = self.max_new_tokens
        while not text.startswith(head := self.tok.decode(ids[:n], skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False)):
            n -= 1  # the cut ends inside a character: keep whole characters of the source
        return Reply(head, reasoning, "length", n)


def run_dataset(todo: list[Regeneration], tok, dg, thinking: ThinkingStyle, sink, bar) -> None:
    """Conversations `CHUNK` at a time, turn by turn in step, so that each turn's prompts and answers are
    tokenized as one batch: the same checks as data_gen/conversation.request_ids, one call per turn."""
    answers = SourceAnswers(tok, dg.max_new_tokens)
    for start in range(0, len(todo), CHUNK):
        chunk = todo[start:start + CHUNK]
        live = [c for c in chunk if c.next_request() is not None]
        while live:
            later = [c for c in live if c.answered]
            for conv, ids in zip(later, prompts_ids(tok, [c.history for c in later], dg.chat_template_kwargs),
                                 strict=True):
                conv.fits(len(ids), dg.max_context_tokens)
            live = [c for c in live if not c.ended_by]
            for conv, reply in zip(live, answers.replies(live), strict=True):
                if reply is None:
                    conv.end("unanswered")
                else:
                    conv.add_reply(reply, thinking)
            live = [c for c in live if not c.ended_by and c.next_request() is not None]
        for conv in chunk:
            sink.add(conv)
            bar.update(1)
