"""Train an EAGLE-3 drafter on hidden-state shards; one Accelerate loop for 1 CPU or N GPUs.

    python -m train --config configs/smollm2-135m-instruct.yaml              # one process
    accelerate launch --config_file scripts/accelerate/multi_gpu.yaml -m train --config ...
    accelerate launch --config_file scripts/accelerate/deepspeed_zero2.yaml -m train --config ...

Reads <run>/hidden, writes <run>/train (checkpoints, metrics.jsonl, W&B offline run, curves.png)
and the SGLang-format drafter to <run>/drafter. A rerun resumes from the latest checkpoint, on any
number of processes (train/position.py, train/checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from core.atomic_io import read_jsonl
from core.config import RunConfig, to_dict
from core.drafter import DrafterConfig, Eagle3Drafter
from core.errors import UserError
from core.hidden_shards import HiddenShards
from core.manifest import check_compat, open_stage_dir, read_manifest, write_manifest
from core.stage_lock import stage_lock
from core.target import TargetHead, load_target_embeddings, resolve_precision, target_info
from train.checkpoint import load_checkpoint, read_latest
from train.data import ShardDataset, aux_rms, precompute_argmax
from train.draft_vocab import build_draft_vocab, d2t_offsets, token_counts
from train.fit import Fit, fit
from train.plots import plot_curves
from train.position import accum_for
from train.ttt_loss import TTTObjective

log = logging.getLogger("train")


def build_drafter(cfg: RunConfig, aux_layers: list[int], draft_ids, t2d, target: TargetHead,
                  aux_scale=None) -> Eagle3Drafter:
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target_info(cfg).path)
    rope = getattr(tc, "rope_parameters", None) or {}
    c = DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        vocab_size=tc.vocab_size, draft_vocab_size=draft_ids.numel(), target_hidden_size=tc.hidden_size,
        aux_layers=aux_layers, target_model_type=tc.model_type, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        max_position_embeddings=tc.max_position_embeddings)
    d = Eagle3Drafter(c)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embed)
        if cfg.train.init_lm_head_from_target:  # start from the target's own output layer
            d.lm_head.weight.copy_(target.lm_head[draft_ids])
            if target.final_norm is not None:
                d.norm.weight.copy_(target.final_norm)
        d.lm_head.requires_grad_(not cfg.train.freeze_lm_head)
        d.d2t.copy_(d2t_offsets(draft_ids))
        d.t2d.copy_(t2d)
        if aux_scale is not None:
            d.aux_scale.copy_(aux_scale)
    return d


def frozen_to_matmul_dtype(drafter: Eagle3Drafter, precision: str) -> None:
    """Under bf16 the frozen embedding (never trained, never exported) needs no fp32 copy: half its memory
    (1 GB at vocab 128k x 4096); its rows feed a norm that computes in fp32 either way."""
    if precision == "bf16":
        drafter.embed_tokens.to(torch.bfloat16)


# how the step is computed, not what it computes: a run may resume with other values
SETTINGS_EXCLUDED = ("log_every", "save_every", "stop_after", "log_samples", "wandb_mode", "wandb_project",
                     "mixed_precision", "attention", "loss_chunk", "compile", "activation_checkpointing")


def training_settings(cfg: RunConfig, hidden_manifest: dict, shards: HiddenShards, precision: str) -> dict:
    """What shapes the drafter: a rerun resumes a checkpoint only when these are the same (the data
    included: grown or re-extracted shards train anew), so the drafter never mixes two runs. The world
    size is not one of them: another number of processes continues the run (train/position.py)."""
    tc = to_dict(cfg.train)
    return {"hidden": hidden_manifest.get("fingerprint"), "data": shards.digest(), "samples": len(shards),
            "seed": cfg.seed, "target.model": cfg.target.model, "precision": precision,
            **{f"train.{k}": v for k, v in tc.items() if k not in SETTINGS_EXCLUDED}}


def make_accelerator(cfg: RunConfig, train_dir: Path) -> Accelerator:
    """cpu=True where no GPU is: without it Accelerate ignores torchrun's ranks on CPU and each
    process trains alone; with it the processes form one gloo group."""
    tc = cfg.train
    if not torch.cuda.is_available():  # DeepSpeed, imported by Accelerate when installed, else warns on every CPU run
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    accelerator = Accelerator(gradient_accumulation_steps=tc.grad_accum, cpu=not torch.cuda.is_available(),
                              mixed_precision=resolve_precision(tc.mixed_precision),
                              log_with="wandb" if tc.wandb_mode != "disabled" else None, project_dir=str(train_dir))
    launched = accelerate_launch_processes()
    if launched > accelerator.num_processes:
        raise UserError(f"`accelerate launch --num_processes {launched}` started {accelerator.num_processes} "
                        "process(es): without GPUs it needs --multi_gpu to start several (CPU processes then "
                        f"train as one gloo group), or use `torchrun --nproc_per_node {launched} -m train ...`")
    return accelerator


def accelerate_launch_processes() -> int:
    """--num_processes of an `accelerate launch` that started this process (1 if none): its single-process
    launcher ignores the flag on a machine without GPUs, which would silently train one process."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return 1
    if "launch" not in parent or not any(a.endswith("accelerate") for a in parent):
        return 1
    for i, a in enumerate(parent):
        value = a.split("=", 1)[1] if a.startswith("--num_processes=") else (
            parent[i + 1] if a == "--num_processes" and i + 1 < len(parent) else None)
        if value is not None and value.isdigit():
            return int(value)
    return 1


def step_options(tc, device: torch.device) -> dict:
    """train.attention / compile / loss_chunk / activation_checkpointing -> TTTObjective's options."""
    cuda = device.type == "cuda"
    choices = {"attention": ("auto", "dense", "flex"), "compile": ("auto", "yes", "no")}
    for key, allowed in choices.items():
        if getattr(tc, key) not in allowed:
            raise UserError(f"train.{key} = {getattr(tc, key)!r}: must be one of {' | '.join(allowed)}")
    attention = ("flex" if cuda else "dense") if tc.attention == "auto" else tc.attention
    if attention == "flex" and not cuda:
        raise UserError("train.attention = flex needs a CUDA device (flex attention has no backward on CPU): "
                        "use train.attention=dense")
    compile = cuda if tc.compile == "auto" else tc.compile == "yes"
    log.info("TTT step: %s attention, fused head loss in chunks of %s rows, compile %s, activation checkpointing %s",
             attention, tc.loss_chunk or "(off)", compile, tc.activation_checkpointing)
    return {"attention": attention, "loss_chunk": tc.loss_chunk, "compile": compile,
            "checkpoint": tc.activation_checkpointing}


def open_run(cfg: RunConfig, accelerator: Accelerator, hm: dict, shards: HiddenShards, fresh: bool):
    """Log where this run trains, and (main process) ready train/ and drafter/ for its settings."""
    train_dir, out = cfg.run_path / "train", cfg.run_path / "drafter"
    precision = accelerator.mixed_precision
    settings = training_settings(cfg, hm, shards, precision)
    runtime = {"world_size": accelerator.num_processes, "device": str(accelerator.device),
               "distributed": str(accelerator.distributed_type), "torch_threads": torch.get_num_threads()}
    log.info("world size %d (%s), device %s, %d torch threads per process, precision %s",
             accelerator.num_processes, accelerator.distributed_type, accelerator.device, torch.get_num_threads(),
             precision)
    if accelerator.is_main_process:
        open_stage_dir(train_dir, "train", settings, fresh)
        if fresh and out.exists():
            shutil.rmtree(out)
        write_manifest(train_dir, "train", cfg, {"target": cfg.target.model}, {"status": "in progress"},
                       {"hidden": str(cfg.run_path / "hidden")}, settings, {"runtime": runtime})
    return settings, runtime


def export(cfg: RunConfig, drafter: Eagle3Drafter, hm: dict, step: int, coverage: float, settings: dict,
           runtime: dict) -> None:
    """The SGLang-format drafter, curves.png, and the manifests of drafter/ and train/."""
    train_dir, out = cfg.run_path / "train", cfg.run_path / "drafter"
    drafter.save_pretrained(out)
    rows = read_jsonl(train_dir / "metrics.jsonl")
    plot_curves(rows, train_dir / "curves.png")
    last = (rows or [{}])[-1]
    compat = {key: hm["compat"][key] for key in ("target", "hidden_size", "vocab_size", "aux_layers")}
    counts = {"steps": step, "draft_vocab_coverage": coverage, "final_metrics": last}
    for d in (out, train_dir):
        write_manifest(d, "train", cfg, compat, counts, {"hidden": str(cfg.run_path / "hidden")}, settings,
                       {"runtime": runtime})
    log.info("drafter exported to %s (final %s)", out, {k: round(v, 4) for k, v in last.items()})


def main(cfg: RunConfig, fresh: bool = False) -> Path:
    train_dir = cfg.run_path / "train"
    accelerator = make_accelerator(cfg, train_dir)
    with stage_lock(train_dir, "train") if accelerator.is_main_process else nullcontext():
        return train(cfg, accelerator, train_dir, fresh)


def train(cfg: RunConfig, accelerator: Accelerator, train_dir: Path, fresh: bool) -> Path:
    tc = cfg.train
    hidden_dir, out = cfg.run_path / "hidden", cfg.run_path / "drafter"
    hm = read_manifest(hidden_dir, "extract")
    check_compat(hm, {"target": cfg.target.model}, hidden_dir)
    precision = accelerator.mixed_precision
    shards = HiddenShards(hidden_dir)
    if tc.loss_on_prompt and not shards.final_everywhere:  # before anything is written
        raise UserError(f"train.loss_on_prompt needs final rows on every token, but {hidden_dir} was extracted "
                        "with extract.spans=loss: re-extract with extract.spans=all or set train.loss_on_prompt=false")
    settings, runtime = open_run(cfg, accelerator, hm, shards, fresh)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    target = load_target_embeddings(cfg)
    draft_ids, t2d, coverage = build_draft_vocab(token_counts(shards, target.embed.shape[0]), tc.draft_vocab_size)
    log.info("%d samples / %d tokens; draft vocab %d covers %.2f%% of assistant tokens",
             len(shards), shards.num_tokens(), draft_ids.numel(), 100 * coverage)
    drafter = build_drafter(cfg, hm["compat"]["aux_layers"], draft_ids, t2d, target, aux_rms(shards))
    frozen_to_matmul_dtype(drafter, precision)
    aux_scale = drafter.aux_scale.to(accelerator.device)
    matmul_dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # bf16 is ~2.7x faster where native
    argmax = precompute_argmax(shards, target.lm_head.to(accelerator.device, matmul_dtype), tc.max_len,
                               tc.loss_on_prompt)
    draft_head = target.lm_head[draft_ids].to(accelerator.device, matmul_dtype)  # [Vd,H]: the teacher's rows
    t2d_dev = t2d.to(accelerator.device)
    ds = ShardDataset(shards, shards.ids, tc.max_len, {"argmax": argmax})
    lengths = [min(shards.rows[i]["length"], tc.max_len) for i in shards.ids]
    objective = TTTObjective(drafter, tc.ttt_steps, tc.loss_decay, **step_options(tc, accelerator.device))
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    ckpt_root = train_dir / "checkpoints"
    latest = read_latest(accelerator, ckpt_root)
    world = accelerator.num_processes
    step_batches = latest["step_batches"] if latest else world * tc.grad_accum  # the run's batches per step
    accelerator.gradient_accumulation_steps = accum = accum_for(step_batches, world)
    if accum * world != step_batches:
        log.warning("this run's optimizer steps take %d batches, which %d processes cannot split: a step takes %d "
                    "(grad_accum %d) and the learning-rate schedule continues by samples", step_batches, world,
                    accum * world, accum)
    if accelerator.state.deepspeed_plugin is not None:  # "auto" needs a prepared loader; ours are per epoch
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.batch_size
    objective, opt = accelerator.prepare(objective, opt)
    step, epoch, epoch_samples = 0, 0, 0
    if latest:
        load_checkpoint(accelerator, ckpt_root, latest, [train_dir / "metrics.jsonl", train_dir / "samples.jsonl"])
        step, epoch, epoch_samples = latest["step"], latest["epoch"], latest["epoch_samples"]
    if tc.wandb_mode != "disabled":  # the mode travels with the run, not through a process-wide env var
        accelerator.init_trackers(tc.wandb_project, config=to_dict(cfg), init_kwargs={
            "wandb": {"dir": str(train_dir), "name": cfg.name, "mode": tc.wandb_mode}})
    f = Fit(cfg, accelerator, objective, opt, ds, lengths, shards, (draft_head, t2d_dev, aux_scale), train_dir,
            step_batches, accum)
    step, stopped = fit(f, step, epoch, epoch_samples)
    accelerator.end_training()
    if stopped:
        log.info("stopped after %d steps of this launch (train.stop_after): rerun to continue from step %d, "
                 "on any number of processes", tc.stop_after, step)
    elif accelerator.is_main_process:
        export(cfg, accelerator.unwrap_model(objective).drafter, hm, step, coverage, settings, runtime)
    return out
