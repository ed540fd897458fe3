"""In-process answers (`hf` backend): the target itself, batched cached decode on CPU or GPU."""

from __future__ import annotations

import torch

from core.engine.decode import EAGER, DecodeRun, Sampling, bf16_copy, generate
from core.run.errors import UserError
from data_gen.openai_client import Reply


class HFBackend:
    def __init__(self, model, tokenizer, stop_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, run: DecodeRun = EAGER):
        self.model, self.tok, self.stop_ids = model, tokenizer, stop_ids
        # bf16: the decode steps run a bf16 copy of the weights (a step is matmul-bound at data_gen's batch
        # sizes: 375 -> 166 ms at 128 rows on 2 AVX512-BF16 cores); the prompt pass stays under autocast
        copy = bf16_copy(model) if run.bf16_prefill and model.dtype != torch.bfloat16 else None
        self.run = run._replace(decode_model=copy)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.rng = torch.Generator(device=model.device).manual_seed(seed)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, rng: torch.Generator):
        try:
            return generate(self.model, prompts, max_new_tokens, self.stop_ids, Sampling(temperature, rng), self.run)
        except torch.OutOfMemoryError as e:  # memory grows with rows x (context + new tokens): say which knob
            raise UserError(f"data_gen: out of {self.model.device.type} memory answering {len(prompts)} prompts of up "
                            f"to {max(map(len, prompts))} tokens (+ {max_new_tokens} new): lower "
                            "data_gen.batch_size or data_gen.max_context_tokens; every conversation finished so far "
                            "is committed, so rerunning the same command continues") from e

    def user_turns(self, header: list[int], rows: int, max_new_tokens: int, temperature: float,
                   seed: int) -> list[str | None]:
        """`rows` user turns sampled after the template's user header (data_gen/self_prompts.py), from their own
        seed: the text of each the target ended itself, None for one cut off at max_new_tokens."""
        rng = torch.Generator(device=self.model.device).manual_seed(seed)
        gens = self._generate([header] * rows, max_new_tokens, temperature, rng)
        return [self.tok.decode(g.tokens[:-1], skip_special_tokens=False) if g.finish_reason == "stop" else None
                for g in gens]

    def answer(self, prompts: list[list[int]]) -> list[Reply]:
        """Replies to templated prompt ids, in order, as one batch: the caller sizes it (data_gen.batch_size)."""
        gens = self._generate(prompts, self.max_new_tokens, self.temperature, self.rng)
        replies = []
        for g in gens:
            body = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens  # without the end-of-turn token
            text = self.tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            replies.append(Reply(text, "", g.finish_reason, len(g.tokens)))
        return replies
