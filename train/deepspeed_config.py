"""DeepSpeed takes the recipe from the run config: one source of truth for what a launch's DeepSpeed JSON also
names. Each key the JSON leaves "auto" (or leaves out) is filled from the run config; a key it sets to another
value than the run's is an error naming both, before anything trains. DeepSpeed clips gradients inside its own
step (`gradient_clipping`), so train.grad_clip reaches it only through this file; bf16 is autocast over fp32
weights, as in a plain run (`precision_keys`).

ZeRO-3 partitions every weight across ranks and gathers a module's weights around that module's own forward. The
TTT step also reads weights outside their module's call (the token half of the attention input's projections, the
draft lm_head in the fused head loss). DeepSpeed 0.19.8 gathers such a weight by itself when an eager step reads
it, but not inside a torch.compile graph (the unroll CUDA runs for wide drafters), so they are registered as
external parameters of the objective: gathered for its whole forward. The export gathers the full weights
(`full_state_dict`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from core.run.config import TrainConfig
from core.run.errors import UserError


def deepspeed_stage(accelerator: Accelerator) -> int | None:
    """The ZeRO stage of this launch, None without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    return None if plugin is None else int(plugin.zero_stage)


def configure_deepspeed(accelerator: Accelerator, tc: TrainConfig, accum: int, precision: str) -> None:
    """Fill the launch's DeepSpeed config from the run's (before `accelerator.prepare`), or refuse a conflict.
    accum: this launch's micro-batches per optimizer step per rank; precision: "bf16" or "fp32"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the DeepSpeed config"
    world = accelerator.num_processes
    ours = {"gradient_clipping": (tc.grad_clip, "train.grad_clip"),
            "gradient_accumulation_steps": (accum, f"micro-batches per step per process (train.grad_accum x the "
                                                   f"run's first world size / {world} processes)"),
            "train_micro_batch_size_per_gpu": (tc.batch_size, "train.batch_size"),
            "train_batch_size": (tc.batch_size * accum * world, f"train.batch_size x {accum} x {world} processes")}
    for key, (value, name) in ours.items():
        have = ds.get(key, "auto")
        if have == "auto":
            ds[key] = value
        elif float(have) != float(value):
            raise UserError(f"{where}: {key} = {have}, but the run's {name} = {value}: set it to \"auto\" (the run "
                            "config is the recipe) or to the same value")
    if deepspeed_stage(accelerator) == 3:
        if tc.tau_every:
            raise UserError("train.tau_every under ZeRO-3: the τ probe decodes with the main process's drafter, which "
                            "holds a partition of the weights there; set train.tau_every=0 (eval measures τ after)")
        ds.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True  # the export
    precision_keys(ds, json.loads(Path(where).read_text()) if Path(where).is_file() else {}, where, tc, precision)


def precision_keys(ds: dict, written: dict, where: str, tc: TrainConfig, precision: str) -> None:
    """bf16 trains as in a plain run: fp32 weights (ZeRO's masters are the weights), matmuls under bf16 autocast,
    which DeepSpeed applies inside its engine (`torch_autocast`; it switches off an autocast opened around it).
    Its own bf16 / fp16 modes (half-precision weights) are off; `written` (the JSON as the user wrote it, before
    Accelerate filled its "auto" values) asking for one is an error."""
    for key in ("bf16", "fp16"):
        if str((written.get(key) or {}).get("enabled", "auto")).lower() not in ("auto", "false"):
            raise UserError(f"{where}: {key}.enabled = true: DeepSpeed's {key} mode trains {key} weights, and this "
                            f"project trains under autocast with fp32 weights (train.mixed_precision = "
                            f"{tc.mixed_precision}: {precision}); set {key}.enabled to \"auto\"")
        ds[key] = {**ds.get(key, {}), "enabled": False}
    autocast = written.get("torch_autocast") or {}
    if "enabled" in autocast and bool(autocast["enabled"]) != (precision == "bf16"):
        raise UserError(f"{where}: torch_autocast.enabled = {autocast['enabled']}, but the run trains in {precision} "
                        f"(train.mixed_precision = {tc.mixed_precision}): leave torch_autocast out")
    ds["torch_autocast"] = {**autocast, "enabled": precision == "bf16", "dtype": "bfloat16"}


def skip_shm_comm_build() -> None:
    """A CPU launch starts DeepSpeed's process group without its shared-memory all-reduce. DeepSpeed's CPU
    accelerator JIT-compiles that op (deepspeed_shm_comm, C++ with OpenMP) when the group starts: ~55 CPU-s on the
    2-core EPYC, needing a compiler, and again for every new venv path (its build key holds the sources' paths).
    Only `inference_all_reduce` calls it; training reduces through torch.distributed over gloo. Marked not
    compatible, `deepspeed.init_distributed` leaves it unbuilt. CUDA accelerators have no such op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def register_external_weights(objective: torch.nn.Module, accelerator: Accelerator) -> None:
    """ZeRO-3: every drafter weight the TTT step reads outside its own module's forward, gathered for the whole
    objective forward (`deepspeed.zero.register_external_parameter`); no-op under other stages."""
    if deepspeed_stage(accelerator) != 3:
        return
    import deepspeed

    drafter = objective.drafter
    for proj in (*drafter.midlayer.self_attn.in_projs(), drafter.lm_head):
        deepspeed.zero.register_external_parameter(objective, proj.weight)


def full_state_dict(accelerator: Accelerator, objective: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The drafter's full weights and buffers, gathered from every rank under ZeRO-3 (every rank must call it; the
    main process gets them, the others None); None for other launches (the module holds them whole)."""
    if deepspeed_stage(accelerator) != 3:
        return None
    state = accelerator.get_state_dict(objective)
    if not accelerator.is_main_process:
        return None
    return {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}


@contextlib.contextmanager
def whole_modules():
    """Models built inside are not partitioned. While a launch's DeepSpeed config says ZeRO-3, transformers builds
    every `from_pretrained` model under ZeRO-3's zero.Init (Accelerate registers the config with it): the frozen
    target that online training runs outside DeepSpeed's engine would be split over the ranks and fail its first
    forward. transformers keeps that registration in one module global, cleared here and put back after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
