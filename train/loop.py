"""Train an EAGLE-3 drafter on hidden-state shards (or online captures); one Accelerate loop for 1 CPU or N GPUs.

    python -m train --config configs/smollm2-135m-instruct.yaml              # one process
    accelerate launch --config_file scripts/accelerate/multi_gpu.yaml -m train --config ...
    accelerate launch --config_file scripts/accelerate/deepspeed_zero2.yaml -m train --config ...

Reads <run>/hidden (train.source=online: <run>/conversations, captured by the target; train/online.py),
writes <run>/train (checkpoints, metrics.jsonl, W&B offline run, curves.png) and the SGLang-format
drafter to <run>/drafter. A rerun resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm import tqdm

from core.atomic_io import append_jsonl, atomic_write_json, atomic_write_text, honour_umask, read_jsonl
from core.config import RunConfig, to_dict
from core.drafter import DrafterConfig, Eagle3Drafter
from core.errors import UserError
from core.manifest import open_stage_dir, write_manifest
from core.stage_lock import stage_lock
from core.target import TargetHead, load_target_embeddings, read_target_config, resolve_precision, target_info
from train.data import ShardSource, aux_rms, collate, length_grouped_batches
from train.draft_vocab import build_draft_vocab, d2t_offsets, token_counts
from train.online import OnlineSource
from train.plots import plot_curves
from train.tau_probe import TauProbe
from train.ttt_loss import TTTObjective, step_metrics, teacher_targets

log = logging.getLogger("train")


def build_drafter(cfg: RunConfig, aux_layers: list[int], draft_ids, t2d, target: TargetHead,
                  aux_scale=None) -> Eagle3Drafter:
    tc = read_target_config(target_info(cfg).path)
    c = DrafterConfig.for_target(tc, aux_layers, draft_ids.numel(), cfg.train.norm_before_fc)
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


def stop_if_not_finite(x: torch.Tensor, what: str, step: int, epoch: int, ids: list[str], source):
    """Training on NaN/inf silently ruins every weight: stop at the first, naming the batch's samples."""
    if not torch.isfinite(x).all():
        raise UserError(f"non-finite {what} ({x.item()}) at step {step} (epoch {epoch}) on samples {ids} of "
                        f"{source.where(ids)}: check those samples, or lower train.lr; nothing was exported")


def lr_lambda(total_steps: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def epoch_loader(ds, lengths: list[int], cfg: RunConfig, epoch: int, accelerator: Accelerator):
    batches = length_grouped_batches(lengths, cfg.train.batch_size, cfg.seed + epoch)
    dl = DataLoader(ds, batch_sampler=batches, collate_fn=collate)
    return accelerator.prepare_data_loader(dl)


def save_checkpoint(accelerator: Accelerator, ckpt_root: Path, step: int, epoch: int, batch: int) -> None:
    path = ckpt_root / f"step-{step:07d}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        honour_umask(path)
        atomic_write_json(ckpt_root / "latest.json", {"path": path.name, "step": step, "epoch": epoch,
                                                       "batch": batch})
        for old in sorted(ckpt_root.glob("step-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, ckpt_root: Path, metrics_path: Path) -> tuple[int, int, int]:
    """Load the latest complete checkpoint, if any -> (step, epoch, batches done in that epoch)."""
    if not (ckpt_root / "latest.json").is_file():
        return 0, 0, 0
    latest = json.loads((ckpt_root / "latest.json").read_text())
    accelerator.load_state(str(ckpt_root / latest["path"]))
    step = latest["step"]
    log.info("resumed from %s (step %d, epoch %d, batch %d)", latest["path"], step, latest["epoch"], latest["batch"])
    if accelerator.is_main_process:  # drop rows logged after the checkpoint; they are redone
        kept = [r for r in read_jsonl(metrics_path) if r["step"] <= step]
        atomic_write_text(metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    return step, latest["epoch"], latest["batch"]


def log_metrics(accelerator: Accelerator, metrics_path: Path, step: int, epoch: int, lr: float,
                sums: dict[str, torch.Tensor], decay: float, extra: dict) -> dict:
    """Per-step sums since the last line, summed across ranks, then divided (step_metrics); plus `extra`
    (τ, measured on the main process)."""
    row = {"step": step, "epoch": epoch, "lr": lr}
    row.update(step_metrics({k: accelerator.reduce(v, "sum") for k, v in sums.items()}, decay))
    row.update(extra)
    accelerator.log(row, step=step)
    if accelerator.is_main_process:
        append_jsonl(metrics_path, [row])
    return row


SOURCES = {"offline": ShardSource, "online": OnlineSource}  # train/data.py: what a source gives the loop
# how the step is computed, not what it computes: a run may resume with other values (source: its own keys)
SETTINGS_EXCLUDED = ("source", "log_every", "save_every", "wandb_mode", "wandb_project", "mixed_precision",
                     "attention", "loss_chunk", "compile", "activation_checkpointing", "tau_every", "tau_prompts",
                     "tau_new_tokens")


def training_settings(cfg: RunConfig, source, world_size: int, precision: str) -> dict:
    """What shapes the drafter: a rerun resumes a checkpoint only when these are the same (the data
    included: grown or re-extracted data trains anew; `source.settings()`), so the drafter never mixes two runs."""
    tc = to_dict(cfg.train)
    return {**source.settings(), "seed": cfg.seed, "target.model": cfg.target.model, "world_size": world_size,
            "precision": precision,
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


def open_run(cfg: RunConfig, accelerator: Accelerator, source, fresh: bool):
    """Log where this run trains, and (main process) ready train/ and drafter/ for its settings."""
    train_dir, out = cfg.run_path / "train", cfg.run_path / "drafter"
    precision = accelerator.mixed_precision
    settings = training_settings(cfg, source, accelerator.num_processes, precision)
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
                       source.inputs, settings, {"runtime": runtime})
    return settings, runtime


def export(cfg: RunConfig, drafter: Eagle3Drafter, source, step: int, coverage: float, settings: dict,
           runtime: dict) -> None:
    """The SGLang-format drafter, curves.png, and the manifests of drafter/ and train/."""
    train_dir, out = cfg.run_path / "train", cfg.run_path / "drafter"
    drafter.save_pretrained(out)
    rows = read_jsonl(train_dir / "metrics.jsonl")
    plot_curves(rows, train_dir / "curves.png")
    last = (rows or [{}])[-1]
    compat = {key: source.compat[key] for key in ("target", "hidden_size", "vocab_size", "aux_layers")}
    counts = {"steps": step, "draft_vocab_coverage": coverage, "final_metrics": last}
    for d in (out, train_dir):
        write_manifest(d, "train", cfg, compat, counts, source.inputs, settings, {"runtime": runtime})
    log.info("drafter exported to %s (final %s)", out, {k: round(v, 4) for k, v in last.items()})


def main(cfg: RunConfig, fresh: bool = False) -> Path:
    if cfg.train.source not in SOURCES:
        raise UserError(f"train.source = {cfg.train.source!r}: must be one of {' | '.join(SOURCES)}")
    train_dir = cfg.run_path / "train"
    accelerator = make_accelerator(cfg, train_dir)
    with stage_lock(train_dir, "train") if accelerator.is_main_process else nullcontext():
        return train(cfg, accelerator, train_dir, fresh)


def train(cfg: RunConfig, accelerator: Accelerator, train_dir: Path, fresh: bool) -> Path:
    tc = cfg.train
    out, precision = cfg.run_path / "drafter", accelerator.mixed_precision
    source = SOURCES[tc.source](cfg, accelerator.device)
    settings, runtime = open_run(cfg, accelerator, source, fresh)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    target = load_target_embeddings(cfg)
    draft_ids, t2d, coverage = build_draft_vocab(token_counts(source.token_pairs(), target.embed.shape[0]),
                                                 tc.draft_vocab_size)
    log.info("%d samples / %d tokens (train.source=%s); draft vocab %d covers %.2f%% of assistant tokens",
             len(source.ids), source.num_tokens(), tc.source, draft_ids.numel(), 100 * coverage)
    drafter = build_drafter(cfg, source.compat["aux_layers"], draft_ids, t2d, target)
    raw_rms = aux_rms(source.aux_samples(), str(source.dir))  # per aux feature: the unit of train.aux_noise
    with torch.no_grad():  # the preconditioner is measured on fc's input (core/drafter.py)
        drafter.aux_scale.copy_(raw_rms if drafter.input_norm is None else
                                aux_rms(source.aux_samples(), str(source.dir), drafter.input_norm))
    frozen_to_matmul_dtype(drafter, precision)
    raw_rms = raw_rms.to(accelerator.device)
    matmul_dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # bf16 is ~2.7x faster where native
    ds = source.dataset(target, matmul_dtype, tc.loss_on_prompt)
    draft_head = target.lm_head[draft_ids].to(accelerator.device, matmul_dtype)  # [Vd,H]: the teacher's rows
    t2d_dev = t2d.to(accelerator.device)
    steps_per_epoch = math.ceil(len(ds) / (tc.batch_size * accelerator.num_processes * tc.grad_accum))
    total_steps = steps_per_epoch * tc.epochs
    objective = TTTObjective(drafter, tc.ttt_steps, tc.loss_decay, **step_options(tc, accelerator.device))
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, max(1, int(tc.warmup_ratio * total_steps))))
    if accelerator.state.deepspeed_plugin is not None:  # "auto" needs a prepared loader; ours are per epoch
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = tc.batch_size
    objective, opt, sched = accelerator.prepare(objective, opt, sched)

    ckpt_root, metrics_path = train_dir / "checkpoints", train_dir / "metrics.jsonl"
    step, start_epoch, skip = resume(accelerator, ckpt_root, metrics_path)
    if tc.wandb_mode != "disabled":  # the mode travels with the run, not through a process-wide env var
        accelerator.init_trackers(tc.wandb_project, config=to_dict(cfg), init_kwargs={
            "wandb": {"dir": str(train_dir), "name": cfg.name, "mode": tc.wandb_mode}})
    window = None  # per-step loss / accuracy sums of the micro-batches since the last log line
    probe = TauProbe(cfg, source.model if tc.source == "online" and tc.tau_every else None)  # one target copy
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    for epoch in range(start_epoch, tc.epochs):
        dl = epoch_loader(ds, source.lengths, cfg, epoch, accelerator)
        if skip:
            dl = accelerator.skip_first_batches(dl, skip)
        for i, batch in enumerate(dl, start=skip):
            batch = source.complete(batch)  # online: the target's captures of this batch
            with accelerator.accumulate(objective):
                mask = batch["valid"] if tc.loss_on_prompt else batch["loss_mask"]
                teacher = teacher_targets(batch["final"], mask, draft_head, t2d_dev, batch["argmax"])
                aux = batch["aux"]
                if tc.aux_noise:  # in units of each raw aux feature's RMS
                    aux = aux + (torch.rand_like(aux) * 2 - 1) * tc.aux_noise * raw_rms
                loss, m = objective(aux, batch["input_ids"], mask, teacher)
                stop_if_not_finite(loss, "loss", step + 1, epoch, batch["ids"], source)
                window = m if window is None else {k: window[k] + v for k, v in m.items()}
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(objective.parameters(), tc.grad_clip)
                    if norm is not None:
                        stop_if_not_finite(norm, "gradient norm", step + 1, epoch, batch["ids"], source)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            measure_tau = probe.due(step, total_steps)
            if step % tc.log_every == 0 or step == total_steps or measure_tau:  # .item() (a sync) only here
                extra = probe.measure(accelerator, objective) if measure_tau else {}
                row = log_metrics(accelerator, metrics_path, step, epoch, sched.get_last_lr()[0], window, tc.loss_decay,
                                  extra)
                window = None
                bar.set_postfix({k: f"{row[k]:.3f}" for k in ("loss", "acc_0", "tau") if k in row})
            if tc.save_every and step % tc.save_every == 0:
                save_checkpoint(accelerator, ckpt_root, step, epoch, i + 1)
        skip = 0
        if not tc.save_every:
            save_checkpoint(accelerator, ckpt_root, step, epoch + 1, 0)
    bar.close()
    accelerator.end_training()
    if accelerator.is_main_process:
        export(cfg, accelerator.unwrap_model(objective).drafter, source, step, coverage, settings, runtime)
    return out
