"""train.kernels.bf16_weights: the trainable weights in bf16, their fp32 masters in the optimizer.

Why: under Accelerate's bf16 autocast the weights are fp32 (4 bytes), their gradients fp32 (4) and autocast
keeps a bf16 copy of each for the backward (2). With bf16 weights the step holds 2 + 2 and no copies; the
fp32 masters move into the optimizer (4), so a whole step with AdamW's moments (8) holds the same 16 bytes
per weight either way, but the forward/backward's peak is lower by ~6 bytes per weight (2.4 GiB for the 8B
drafter's 425M). SpecForge trains this way (its BF16Optimizer). The forward computes what autocast computes
(autocast casts the fp32 weights to bf16 too); the gradients of a weight's K TTT uses are summed in bf16.
"""

import torch


def weights_to_bf16(module: torch.nn.Module) -> None:
    """Every floating parameter to bf16 in place; buffers (t2d, d2t, aux_scale) stay as they are."""
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose parameters are bf16 weights: each step copies their gradients into fp32 masters, steps
    torch's AdamW on the masters and writes the masters back rounded to bf16. state_dict carries the
    masters, so a resumed run continues from the fp32 values, not the rounded weights."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, fused: bool | None = None):
        params = list(params)
        self.masters = [p.detach().float().clone() for p in params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
        super().__init__(params, dict(self.inner.defaults))

    @torch.no_grad()
    def step(self, closure=None):
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # the lr the loop set
        weights = [p for group in self.param_groups for p in group["params"]]
        for p, m in zip(weights, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        for p, m in zip(weights, self.masters, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "masters": list(self.masters)}  # references, as torch's own

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state_dict["masters"], strict=True):
                m.copy_(saved)
