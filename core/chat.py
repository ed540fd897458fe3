"""Chat-template rendering shared by data_gen (prompts to answer) and eval (prompts to decode)."""

from __future__ import annotations


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the target's template, ending in the assistant header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
