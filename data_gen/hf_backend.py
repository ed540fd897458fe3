"""In-process answers (`hf` backend): the target itself, batched cached decode on CPU or GPU."""

from __future__ import annotations

import torch

from core.decode import generate
from data_gen.openai_client import Reply


class HFBackend:
    def __init__(self, model, tokenizer, stop_ids: list[int], max_new_tokens: int, temperature: float,
                 batch_size: int, seed: int, bf16_prefill: bool, graphs: bool):
        self.model, self.tok, self.stop_ids, self.bf16_prefill = model, tokenizer, stop_ids, bf16_prefill
        self.graphs = graphs
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        self.rng = torch.Generator(device=model.device).manual_seed(seed)

    def answer(self, prompts: list[list[int]], on_batch=None) -> list[Reply]:
        """Replies to templated prompt ids, in order; batches rows of similar length (less padding)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        replies: list[Reply | None] = [None] * len(prompts)
        for b in range(0, len(order), self.batch_size):
            rows = order[b:b + self.batch_size]
            gens = generate(self.model, [prompts[i] for i in rows], self.max_new_tokens, self.stop_ids,
                            self.temperature, self.rng, self.bf16_prefill, self.graphs)
            for i, g in zip(rows, gens, strict=True):
                body = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens  # without the end-of-turn token
                text = self.tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                replies[i] = Reply(text, "", g.finish_reason, len(g.tokens))
            if on_batch is not None:
                on_batch(len(rows))
        return replies
