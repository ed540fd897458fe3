"""Token ids and loss mask of a regenerated conversation, from the target's own chat template.

Why prefix rendering and not per-template regexes: every model family marks turns differently
(ChatML, Llama-3 headers, Kimi's <|im_middle|>, DeepSeek's full-width bars) and regexes break on the
next one. Here the text of assistant turn i is whatever the template adds between
`render(messages[:i], add_generation_prompt=True)` and `render(messages[:i+1])`. The mask covers that
span up to and including its first end-of-turn marker: exactly what the target emits at serving
time (a length-truncated answer never emitted the marker, so it stays unmasked), never the
template's trailer after it ("\n" in ChatML).

Each piece is tokenized on its own, like a server does (prompt tokenized, generated tokens
appended), and the result must decode back to the template's rendering of the whole conversation.
A template that rewrites earlier turns once a new one is added (Qwen3 and DeepSeek-R1 drop past
reasoning) starts a new sample at that turn, so every sample is a prefix the server really saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.run.errors import UserError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class TemplateError(ValueError):
    """The chat template can't be segmented into prompt and generated spans."""


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))


@dataclass(frozen=True)
class ThinkingStyle:
    """What storing a reply needs to know about reasoning: data_gen.reasoning, whether the template renders
    `reasoning_content` itself, and whether its generation prompt already opens a <think> block (Kimi-K2.5,
    Qwen3 with thinking on), so that what the model writes is reasoning up to its first </think>."""
    mode: str
    template_renders: bool
    prompt_opens: bool


def thinking_style(tokenizer, mode: str, template_kwargs: dict | None = None) -> ThinkingStyle:
    opens = render(tokenizer, [{"role": "user", "content": "q"}], True, template_kwargs).rstrip().endswith(THINK_OPEN)
    return ThinkingStyle(mode, mode == "render" and template_renders_reasoning(tokenizer, template_kwargs), opens)


def split_reasoning(content: str | None, reasoning: str | None, prompt_opens: bool = False) -> tuple[str, str]:
    """(answer, reasoning) from a reply: `reasoning_content` if the server parsed it; after a generation prompt
    that opened <think>, the text up to the first </think> (all of it when cut off while thinking), kept
    byte for byte so the template renders exactly what was generated; else a leading <think>...</think> block."""
    content = content or ""
    if reasoning:
        return content, reasoning
    if prompt_opens:
        think, close, answer = content.partition(THINK_CLOSE)
        return (answer, think) if close else ("", content)
    stripped = content.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        think, answer = stripped[len(THINK_OPEN):].split(THINK_CLOSE, 1)
        return answer.lstrip("\n"), think.strip("\n")
    return content, ""


def template_renders_reasoning(tokenizer, template_kwargs: dict | None = None) -> bool:
    """True when the template itself renders an assistant message's `reasoning_content` field."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    marked = [probe[0], {**probe[1], "reasoning_content": "r3a5oning-probe"}]
    return "r3a5oning-probe" in render(tokenizer, marked, False, template_kwargs) \
        and "r3a5oning-probe" not in render(tokenizer, probe, False, template_kwargs)


def assistant_message(content: str, reasoning: str, mode: str, template_has_reasoning: bool) -> dict:
    """The assistant message as stored and rendered, per data_gen.reasoning:
    drop (reasoning discarded), field (stored, not trained on), render (trained on: the template's
    thinking markup, or an inline <think> block when the template has none)."""
    if mode == "drop" or not reasoning:
        return {"role": "assistant", "content": content}
    if mode == "field":
        return {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if mode == "render":
        if template_has_reasoning:
            return {"role": "assistant", "content": content, "reasoning_content": reasoning}
        return {"role": "assistant", "content": f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"}
    raise UserError(f"data_gen.reasoning = {mode!r}: use drop | field | render")


def tokenize_conversation(tokenizer, messages: list[dict], end_of_turn: list[str], truncated: list[bool],
                          template_kwargs: dict | None = None, render_reasoning: bool = True) -> list[TokenizedSample]:
    """Samples (ids, mask) for `messages`; truncated[i] says assistant message i hit max_tokens.
    `render_reasoning=False` strips `reasoning_content` before rendering (mode `field`)."""
    msgs = messages if render_reasoning else [{k: v for k, v in m.items() if k != "reasoning_content"}
                                              for m in messages]
    samples: list[TokenizedSample] = []
    covered, ids, mask = "", [], []

    def add(text: str, bit: int) -> None:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids.extend(piece)
        mask.extend([bit] * len(piece))

    def close() -> None:
        _check_round_trip(tokenizer, ids, covered)
        samples.append(TokenizedSample(list(ids), list(mask)))

    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, msgs[:i], True, template_kwargs)
        full = render(tokenizer, msgs[:i + 1], False, template_kwargs)
        if not full.startswith(prefix):
            raise TemplateError(f"chat template: rendering assistant turn {i} does not extend the generation "
                                f"prompt ({prefix[-40:]!r} ...), so its tokens can't be located")
        if not prefix.startswith(covered):  # the template rewrote an earlier turn: new sample
            close()
            covered, ids[:], mask[:] = "", [], []
        span = full[len(prefix):]
        if m["content"] not in span:
            raise TemplateError(f"chat template: assistant turn {i}'s content is not rendered verbatim")
        end = _generated_end(span, m["content"] or m.get("reasoning_content", ""), end_of_turn, truncated[i], i)
        add(prefix[len(covered):], 0)
        add(span[:end], 1)
        covered = prefix + span[:end]
    if not ids:
        raise TemplateError("conversation has no assistant turn")
    whole = render(tokenizer, msgs, False, template_kwargs)
    if whole.startswith(covered):  # the trailer after the last end-of-turn
        add(whole[len(covered):], 0)
        covered = whole
    close()
    return samples


def _generated_end(span: str, content: str, end_of_turn: list[str], truncated: bool, turn: int) -> int:
    """Offset in the assistant span just past what the target generated (`content`: the answer, or the
    reasoning of a reply cut off while thinking)."""
    after_content = span.index(content) + len(content)
    if truncated:
        return after_content
    hits = [(span.find(e, after_content), e) for e in end_of_turn if e and span.find(e, after_content) >= 0]
    if not hits:
        raise TemplateError(f"chat template: no end-of-turn marker {end_of_turn} after assistant turn {turn}'s "
                            f"content (span ends {span[-30:]!r}); set data_gen.end_of_turn")
    pos, marker = min(hits)
    return pos + len(marker)


def _check_round_trip(tokenizer, ids: list[int], text: str) -> None:
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if decoded != text:
        at = next((k for k, (a, b) in enumerate(zip(decoded, text, strict=False)) if a != b),
                  min(len(decoded), len(text)))
        raise TemplateError(f"tokenized conversation does not decode back to the rendered template "
                            f"(first difference at char {at}: {decoded[at:at + 20]!r} vs {text[at:at + 20]!r})")
