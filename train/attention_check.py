"""train.kernels.attention=cudnn checks itself on the device before a run trains with it.

Why: on a GPU a fused-kernel TTT attention once gave every weight's gradient percents off (strided inputs to
the CUDA kernel) while every CPU test passed. A kernel, driver or torch version can differ again, and a wrong
gradient trains quietly. So train runs one small TTT step with the kernel and with the
dense reference path, same weights and batch, under the precision it will train in (bf16 autocast on CUDA),
and stops with a one-line error if any weight's gradient differs by more than `LIMIT` (~1 s on a GPU,
~2 s on a CPU, where it runs in fp32).
"""

import logging

import torch

from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import MLAShape
from core.run.errors import UserError
from train.ttt_loss import Rows, StepOptions, teacher_targets, ttt_loss

log = logging.getLogger("train")
LIMIT = 0.03  # bf16 on a GPU: flex and the merged attention stay under 1%, the broken one was far over


# an MLA layer of the kind the run trains: q/k heads 64 + 32 wide over v heads of 64 (the kernel pads v)
CHECK_MLA = MLAShape(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


def merged_gradient_errors(device: torch.device, mla: bool = False) -> dict[str, float]:
    """-> {parameter: |grad_merged - grad_dense| / |grad_dense|} for one TTT step (K=4, batch 2 x 300 tokens,
    60% of them in the loss, 4/2 heads of 64, or 4 MLA heads) on random O(1) weights. The caller's RNG state is
    left as it was."""
    c = DrafterConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, vocab_size=2048, draft_vocab_size=512, target_hidden_size=256,
                      mla=CHECK_MLA if mla else None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(device):
            d = Eagle3Drafter(c)
            for p in d.parameters():
                if p.dim() == 2:
                    torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
            d.t2d[:512] = True
            b, t = 2, 300
            aux, final = torch.randn(b, t, 3 * 256), torch.randn(b, t, 256)
            ids, argmax = torch.randint(0, 2048, (b, t)), torch.randint(0, 512, (b, t))
            mask = (torch.rand(b, t) < 0.6).to(torch.uint8)
            teacher = teacher_targets(final, mask, torch.randn(512, 256), d.t2d, argmax)
    grads = {}
    for attention in ("dense", "merged"):
        d.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = ttt_loss(d, Rows(aux, ids, mask), teacher, 4, 0.8, StepOptions(attention))
        loss.backward()
        grads[attention] = {n: p.grad.float() for n, p in d.named_parameters() if p.grad is not None}
    return {n: float((grads["merged"][n] - g).norm() / g.norm()) for n, g in grads["dense"].items()}


def check_merged_attention(device: torch.device, mla: bool = False) -> None:
    """Raise UserError if the merged attention's gradients on `device` (for an MLA drafter's layout with `mla`)
    are more than LIMIT off the dense path's."""
    errors = merged_gradient_errors(device, mla)
    worst = max(errors, key=errors.get)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if errors[worst] > LIMIT:
        raise UserError(f"train.kernels.attention = cudnn: on this {name} its gradients differ from the dense path's "
                        f"by up to {errors[worst]:.1%} ({worst}; {LIMIT:.0%} allowed): use train.kernels.attention=flex")
    log.info("train.kernels.attention = cudnn checked on this %s: gradients within %.2f%% of the dense path's (%s)",
             name, 100 * errors[worst], worst)
