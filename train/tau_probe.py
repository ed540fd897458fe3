"""τ during training: the drafter as it would be exported, decoded by eval's engine on eval's prompts.

Training accuracy can be high while serving accepts almost nothing (the field's most common
complaint); a τ curve beside loss_k / acc_k shows that while the run goes. Same code as eval's hf
engine: `speculative_generate` at T=0 with a chain of K = eval.draft_steps, on the first
train.tau_prompts of eval's prompts (held-out ShareGPT by default), train.tau_new_tokens each. The target is
loaded on the first measurement, on the main process only (online training's own copy where it has one).
"""

from __future__ import annotations

import torch

from core.drafters.drafter import Eagle3Drafter
from core.engine.cpu_linear import split_cpu_linears
from core.engine.speculative import Drafting, acceptance_length, speculative_generate
from core.run.config import RunConfig
from core.target.chat import eval_prompt_ids
from core.target.model import end_of_turn_ids, load_target, load_tokenizer


class TauProbe:
    def __init__(self, cfg: RunConfig, model=None):
        self.cfg, self.model, self.items = cfg, model, None

    def due(self, step: int, total_steps: int) -> bool:
        every = self.cfg.train.tau_every
        return bool(every) and (step % every == 0 or step == total_steps)

    def measure(self, accelerator, objective) -> dict:
        """{"tau": τ} on the main process ({} elsewhere); every process waits for it."""
        out = {"tau": self(accelerator.unwrap_model(objective).drafter)} if accelerator.is_main_process else {}
        accelerator.wait_for_everyone()
        return out

    @torch.no_grad()
    def __call__(self, drafter: Eagle3Drafter) -> float:
        if self.items is None:
            self.model = self.model or load_target(self.cfg)[0]
            tok = load_tokenizer(self.cfg)
            self.stop = end_of_turn_ids(tok, self.model.generation_config)
            self.items = eval_prompt_ids(self.cfg, tok, limit=self.cfg.train.tau_prompts)
        with torch.random.fork_rng(devices=[]):  # building the copy draws init weights: keep training's RNG stream
            draft = split_cpu_linears(drafter.exported_copy().to(self.model.device, self.model.dtype).eval())
        lengths = []
        for _, ids in self.items:
            out = speculative_generate(self.model, draft, ids, self.cfg.train.tau_new_tokens, self.stop,
                                       Drafting(self.cfg.eval.draft_steps, p_min=self.cfg.eval.draft_p_min))
            lengths += out.drafting_rounds()
        return acceptance_length(lengths)
