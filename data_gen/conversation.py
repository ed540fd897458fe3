"""On-policy multi-turn regeneration: keep a conversation's user turns, answer each with the target.

Every assistant turn is regenerated conditioned on the target's own earlier answers (the original
assistant turns are discarded), so the data is what the target produces when served. Backends only
answer requests; this file decides what to ask and turns the result into training rows. The one
exception, backend `dataset` (data_gen/dataset_backend.py), answers with the source's own turns,
which each conversation carries in `answers` for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.target.chat import prompt_ids
from core.target.prompts import Prompt
from data_gen.chat_tokenize import ThinkingStyle, assistant_message, split_reasoning, tokenize_conversation
from data_gen.openai_client import Reply


@dataclass
class Regeneration:
    id: str  # sample id: the prompt id, or <id>~<j> for answer j of n
    source_id: str
    turns: list[dict]  # system + user messages to replay, in order
    seed: int | None = None
    answers: list[dict | None] = field(default_factory=list)  # the source's, per kept user turn (source_answers)
    messages: list[dict] = field(default_factory=list)  # as stored and rendered (may carry reasoning)
    history: list[dict] = field(default_factory=list)  # as sent to the server (answers only)
    truncated: list[bool] = field(default_factory=list)  # per message: assistant hit max_tokens
    ended_by: str = ""  # "" while running | "turns" | "context" | "rejected" (openai) | "unanswered" (dataset)
    pos: int = 0

    def next_request(self) -> list[dict] | None:
        """Messages for the next answer, or None when every kept user turn is answered."""
        if self.ended_by:
            return None
        start = self.pos
        while self.pos < len(self.turns) and self.turns[self.pos]["role"] != "user":
            self.pos += 1
        if self.pos >= len(self.turns):
            self.pos, self.ended_by = start, "turns"
            return None
        for m in self.turns[start:self.pos + 1]:
            self.messages.append(dict(m))
            self.history.append({"role": m["role"], "content": m["content"]})
            self.truncated.append(False)
        self.pos += 1
        return list(self.history)

    def end(self, reason: str) -> None:
        """Stop before the pending user turn (e.g. its prompt no longer fits the context)."""
        while self.messages and self.messages[-1]["role"] != "assistant":
            self.messages.pop()
            self.history.pop()
            self.truncated.pop()
        self.ended_by = reason

    def fits(self, prompt_tokens: int, max_context_tokens: int) -> bool:
        """Whether the pending request's templated prompt fits; a later turn's that doesn't ends the
        conversation before it (the first turn was checked against max_prompt_tokens at selection)."""
        if self.answered and prompt_tokens > max_context_tokens:
            self.end("context")
            return False
        return True

    def add_reply(self, reply: Reply, thinking: ThinkingStyle) -> None:
        answer, reasoning = split_reasoning(reply.content, reply.reasoning, thinking.prompt_opens)
        self.messages.append(assistant_message(answer, reasoning, thinking.mode, thinking.template_renders))
        self.history.append({"role": "assistant", "content": answer})
        self.truncated.append(reply.finish_reason == "length")

    @property
    def answered(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


def replay_turns(prompt: Prompt, max_turns: int) -> list[dict]:
    """The system and user messages of the first max_turns user turns (0 = all)."""
    kept, users = [], 0
    for m in prompt.messages:
        if m["role"] == "assistant":
            continue
        if m["role"] == "user":
            if max_turns and users == max_turns:
                break
            users += 1
        kept.append({"role": m["role"], "content": m["content"]})
    return kept


def source_answers(prompt: Prompt, max_turns: int) -> list[dict | None]:
    """The source's answer to each of the first max_turns user turns (0 = all): the message right after
    that turn when it is an assistant's, else None."""
    msgs = prompt.messages
    answers = [msgs[i + 1] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
               for i, m in enumerate(msgs) if m["role"] == "user"]
    return answers[:max_turns] if max_turns else answers


def regenerations(prompt: Prompt, max_turns: int, n: int, request_seed: int | None) -> list[Regeneration]:
    turns, answers = replay_turns(prompt, max_turns), source_answers(prompt, max_turns)
    if n == 1:
        return [Regeneration(prompt.id, prompt.id, turns, request_seed, answers)]
    return [Regeneration(f"{prompt.id}~{j}", prompt.id, turns, None if request_seed is None else request_seed + j,
                         answers) for j in range(n)]


def request_ids(conv: Regeneration, tok, dg) -> list[int] | None:
    """Templated ids of the conversation's next request, or None when it is finished."""
    req = conv.next_request()
    if req is None:
        return None
    ids = prompt_ids(tok, req, dg.chat_template_kwargs)
    return ids if conv.fits(len(ids), dg.max_context_tokens) else None


def to_rows(conv: Regeneration, tokenizer, end_of_turn: list[str], reasoning_mode: str, template_kwargs: dict,
            model_id: str, thash: str) -> list[dict]:
    """Training rows for a finished regeneration: one, or one per stretch the template keeps verbatim."""
    samples = tokenize_conversation(tokenizer, conv.messages, end_of_turn, conv.truncated, template_kwargs,
                                    render_reasoning=reasoning_mode == "render")
    finish = "length" if any(conv.truncated) else "stop"
    stored = [{"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning_content", "")}
              for m in conv.messages]
    return [{"id": conv.id if len(samples) == 1 else f"{conv.id}#{k}", "conversation_id": conv.id,
             "messages": stored, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "finish_reason": finish,
             "turns": conv.answered, "template_hash": thash, "model_id": model_id}
            for k, s in enumerate(samples)]
