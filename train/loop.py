"""Train an EAGLE-3 drafter on hidden-state shards (or online captures); one Accelerate loop for 1 CPU or N GPUs.

    python -m train --config configs/smollm2-135m-instruct.yaml              # one process
    accelerate launch --config_file scripts/accelerate/multi_gpu.yaml -m train --config ...
    accelerate launch --config_file scripts/accelerate/deepspeed_zero2.yaml -m train --config ...

Reads <run>/hidden (train.source=online: <run>/conversations, captured by the target; train/online.py),
writes <run>/train (checkpoints, metrics.jsonl, W&B offline run, curves.png) and the SGLang-format
drafter to <run>/drafter. A rerun resumes from the latest checkpoint, on any number of processes
(train/position.py, train/checkpoint.py); the step loop is train/fit.py.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed

from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import DraftVariant
from core.run.config import RunConfig, TrainConfig, TrainKernels, to_dict
from core.run.errors import UserError
from core.storage import trained_prompts
from core.storage.atomic_io import atomic_write_json, read_jsonl
from core.storage.manifest import open_stage_dir, write_manifest
from core.storage.stage_lock import stage_lock, stage_reader
from core.target.model import (
    TargetHead,
    load_target_embeddings,
    read_target_config,
    resolve_precision,
    target_info,
    verifier_of,
)
from train.attention_check import check_merged_attention
from train.checkpoint import load_checkpoint, read_latest, trim_logs
from train.data import ShardSource, aux_rms
from train.deepspeed_config import (
    configure_deepspeed,
    full_state_dict,
    register_external_weights,
    skip_shm_comm_build,
)
from train.dflash_loss import DFlashObjective
from train.draft_vocab import (
    COUNTS_FILE,
    build_draft_vocab,
    check_draft_vocab_size,
    counts_record,
    d2t_offsets,
    token_counts,
)
from train.fit import Fit, TeacherHead, fit
from train.loss_kind import HeadLoss
from train.master_weights import MasterWeightAdamW, weights_to_bf16
from train.plots import plot_curves
from train.position import accum_for
from train.tau_probe import TauProbe
from train.ttt_loss import StepOptions, TTTObjective

log = logging.getLogger("train")
SPECULATORS_DIR = "drafter-speculators"  # <run>/: the drafter in vLLM speculators' format


def drafter_config(cfg: RunConfig, aux_layers: list[int], draft_vocab_size: int) -> DrafterConfig:
    """The drafter train builds for cfg's target, with the EAGLE-3.1 variant cfg.train asks for."""
    tc = read_target_config(target_info(cfg).path)
    return DrafterConfig.for_target(tc, aux_layers, draft_vocab_size, DraftVariant.of(tc, cfg.train))


def build_drafter(cfg: RunConfig, aux_layers: list[int], draft_ids, t2d, target: TargetHead,
                  aux_scale=None) -> Eagle3Drafter:
    d = Eagle3Drafter(drafter_config(cfg, aux_layers, draft_ids.numel()))
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


def make_source(cfg: RunConfig, device: torch.device):
    """train.source -> what the loop reads (train/data.py says what a source gives it). The online source, and the
    conversation reader under it (datasets, pyarrow), are imported only for online runs: a GPU node that trains
    from shards needs neither."""
    if cfg.train.source == "offline":
        return ShardSource(cfg, device)
    from train.online import OnlineSource

    return OnlineSource(cfg, device)


# how the step is computed, not what it computes: a run may resume with other values (source: its own keys)
SETTINGS_EXCLUDED = ("source", "log_every", "save_every", "stop_after", "log_samples", "wandb_mode", "wandb_project",
                     "mixed_precision", "kernels", "tau_every", "tau_prompts", "tau_new_tokens", "epoch_drafters")


def training_settings(cfg: RunConfig, source, precision: str) -> dict:
    """What shapes the drafter: a rerun resumes a checkpoint only when these are the same (the data
    included: grown or re-extracted data trains anew; `source.settings()`), so the drafter never mixes two
    runs. The world size is not one of them: another number of processes continues the run (train/position.py)."""
    tc = to_dict(cfg.train)
    return {**source.settings(), "seed": cfg.seed, "target.model": cfg.target.model, "precision": precision,
            **{f"train.{k}": v for k, v in tc.items() if k not in SETTINGS_EXCLUDED},
            "train.kernels.bf16_weights": cfg.train.kernels.bf16_weights}  # the checkpoint's layout


def make_accelerator(cfg: RunConfig, train_dir: Path) -> Accelerator:
    """cpu=True where no GPU is: without it Accelerate ignores torchrun's ranks on CPU and each
    process trains alone; with it the processes form one gloo group."""
    tc = cfg.train
    if not torch.cuda.is_available():  # DeepSpeed, imported by Accelerate when installed, else warns on every CPU run
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"  # set by accelerate launch
    if deepspeed and not torch.cuda.is_available():  # DeepSpeed's CPU accelerator over gloo: Accelerate would take
        skip_shm_comm_build()                        # no backend, and each rank would count itself alone; no C++
        PartialState(cpu=False, backend="gloo")      # build of an all-reduce that training never calls
    accelerator = Accelerator(gradient_accumulation_steps=tc.grad_accum, cpu=not torch.cuda.is_available() and not deepspeed,
                              mixed_precision="bf16" if resolve_precision(tc.mixed_precision) == "bf16" else "no",
                              log_with="wandb" if tc.wandb_mode != "disabled" else None, project_dir=str(train_dir))
    launched = accelerate_launch_processes()
    if launched > accelerator.num_processes:
        raise UserError(f"`accelerate launch --num_processes {launched}` started {accelerator.num_processes} "
                        "process(es): without GPUs it needs --multi_gpu to start several (CPU processes then "
                        f"train as one gloo group), or use `torchrun --nproc_per_node {launched} -m train ...`")
    return accelerator


def autocast_of(accelerator: Accelerator) -> str:
    """The precision the run trains in, in the config's words: "bf16" or "fp32" (Accelerate says "no")."""
    return "bf16" if accelerator.mixed_precision == "bf16" else "fp32"


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


# flex attention's CUDA kernels take head dims of at least this (torch 2.11's inductor lowering)
FLEX_MIN_HEAD_DIM = 16
# below this drafter width a step is launch-bound: there dense attention in eager steps trained fastest on a GPU
# (compiled graphs cost their compile time and gained nothing back; docs/PERFORMANCE.md, train)
COMPILED_MIN_HIDDEN = 2048


def cudnn_takes(head_dim: int) -> bool:
    """cuDNN's fused attention, forward and backward, takes head dims that are multiples of 8 up to 128."""
    return head_dim % 8 == 0 and head_dim <= 128


def auto_attention(kernels: TrainKernels, cuda: bool, dc: DrafterConfig) -> str:
    """train.kernels.attention=auto: dense on CPU and for narrow drafters; on CUDA cuDNN's kernel for right-padded
    rows, flex for packed rows or where cuDNN does not take the head dim, dense where flex does not either."""
    if not cuda or dc.hidden_size < COMPILED_MIN_HIDDEN:
        return "dense"
    if cudnn_takes(dc.kernel_head_dim) and not kernels.pack_length:
        return "cudnn"
    return "flex" if dc.qk_head_dim >= FLEX_MIN_HEAD_DIM else "dense"


def step_options(kernels: TrainKernels, device: torch.device, dc: DrafterConfig) -> StepOptions:
    """train.kernels -> TTTObjective's StepOptions for the drafter `dc` on `device` (train.kernels.pack_length is
    train/fit.py's: it packs the batch, and TTTObjective reads the packed rows' doc_ids and positions). auto picks
    the fastest paths measured (docs/PERFORMANCE.md): `auto_attention`, and on CUDA the K steps as one compiled
    graph for drafters of at least COMPILED_MIN_HIDDEN."""
    cuda, head_dim = device.type == "cuda", dc.qk_head_dim
    attention = auto_attention(kernels, cuda, dc) if kernels.attention == "auto" else kernels.attention
    if attention == "flex" and head_dim < FLEX_MIN_HEAD_DIM:
        raise UserError(f"train.kernels.attention = flex: its CUDA kernels need a head dim of at least "
                        f"{FLEX_MIN_HEAD_DIM}, this drafter's is {head_dim}: use train.kernels.attention=dense (or auto)")
    if attention == "flex" and not cuda:
        raise UserError("train.kernels.attention = flex needs a CUDA device (flex attention has no backward on CPU): "
                        "use train.kernels.attention=dense")
    if attention == "cudnn" and kernels.pack_length:
        raise UserError("train.kernels.attention = cudnn takes one document per row: use flex (or dense) with "
                        "train.kernels.pack_length, or set train.kernels.pack_length=0")
    if attention == "cudnn" and cuda and not cudnn_takes(dc.kernel_head_dim):
        raise UserError(f"train.kernels.attention = cudnn: cuDNN takes head dims that are multiples of 8 up to 128, "
                        f"this drafter's is {dc.kernel_head_dim}: use train.kernels.attention=flex (or auto)")
    unroll = kernels.compile == "unroll" or (kernels.compile == "auto" and cuda and dc.hidden_size >= COMPILED_MIN_HIDDEN)
    steps = f"one compiled graph ({kernels.compile_backend})" if unroll else "eager"
    log.info("TTT step: %s attention, fused head loss in chunks of %s rows, %s, activation checkpointing %s, "
             "batches %s%s", attention, kernels.loss_chunk or "(off)", steps,
             kernels.activation_checkpointing,
             f"packed into rows of {kernels.pack_length} tokens" if kernels.pack_length else "right-padded",
             "" if unroll else ", steps >= 1 on the counted rows only")
    # eager steps skip the rows no later step counts (~1/3 less compute on the demo); graphs keep static shapes
    return StepOptions("merged" if attention == "cudnn" else attention, kernels.loss_chunk,
                       kernels.activation_checkpointing, unroll, prune_rows=not unroll,
                       compile_backend=kernels.compile_backend)


def make_optimizer(params: list[torch.Tensor], tc: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable weights: they are the fp32 masters, or (train.kernels.bf16_weights) bf16 weights whose
    masters the optimizer keeps (bench/bench_train_step.py --with-optimizer times the same one). Fused (one
    kernel over all weights) where torch has it: the demo drafter's 7.1M weights step in ~2 ms on 2 CPU cores
    against 6-15 ms for the default foreach loop (~10 ms of a ~200 ms demo step), the same values to 5e-8."""
    optimizer = MasterWeightAdamW if tc.kernels.bf16_weights else torch.optim.AdamW
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return optimizer(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay, fused=fused)


def open_run(cfg: RunConfig, accelerator: Accelerator, source, fresh: bool):
    """Log where this run trains, and (main process) ready train/ and drafter/ for its settings."""
    train_dir, outs = cfg.run_path / "train", (cfg.run_path / "drafter", cfg.run_path / SPECULATORS_DIR)
    precision = autocast_of(accelerator)
    settings = training_settings(cfg, source, precision)
    runtime = {"world_size": accelerator.num_processes, "device": str(accelerator.device),
               "distributed": str(accelerator.distributed_type), "torch_threads": torch.get_num_threads()}
    log.info("world size %d (%s), device %s, %d torch threads per process, precision %s",
             accelerator.num_processes, accelerator.distributed_type, accelerator.device, torch.get_num_threads(),
             precision)
    if accelerator.is_main_process:
        open_stage_dir(train_dir, "train", settings, fresh)
        for out in outs if fresh else ():
            if out.exists():
                shutil.rmtree(out)
        write_manifest(train_dir, "train", cfg, {"target": cfg.target.model}, {"status": "in progress"},
                       source.inputs, settings, {"runtime": runtime})
    return settings, runtime


@dataclass
class Exporter:
    """Writes the SGLang-format drafter with its records (the draft tokens' counts for `python -m
    train.prune_vocab`, the trained prompts' digests for eval) and its manifest (its target, which eval checks):
    at the run's end (epoch None) into drafter/, with curves.png and train/'s manifest, and the same weights in
    speculators' format into drafter-speculators/ (`vllm serve` reads it alone) where that format can hold the
    drafter; after an epoch (train.epoch_drafters) into train/epochs/epoch-N."""
    cfg: RunConfig
    source: object  # ShardSource | OnlineSource: compat and inputs for the manifest
    coverage: float  # the draft vocab's share of the assistant tokens
    settings: dict
    runtime: dict
    records: dict[str, dict]

    def __call__(self, drafter: Eagle3Drafter, step: int, epoch: int | None = None) -> None:
        cfg, source = self.cfg, self.source
        train_dir = cfg.run_path / "train"
        out = cfg.run_path / "drafter" if epoch is None else train_dir / "epochs" / f"epoch-{epoch}"
        drafter.save_pretrained(out)
        outs = [out] if epoch is not None else [out, *self.speculators_copy(drafter, out)]
        for d in outs:
            for name, record in self.records.items():
                atomic_write_json(d / name, record)
        rows = read_jsonl(train_dir / "metrics.jsonl")
        if epoch is None:
            plot_curves(rows, train_dir / "curves.png")
        last = (rows or [{}])[-1]
        compat = {key: source.compat[key] for key in ("target", "hidden_size", "vocab_size", "aux_layers")}
        counts = {"steps": step, "draft_vocab_coverage": self.coverage, "final_metrics": last,
                  **({} if epoch is None else {"epoch": epoch})}
        for d in outs if epoch is not None else [*outs, train_dir]:
            write_manifest(d, "train", cfg, compat, counts, source.inputs, self.settings, {"runtime": self.runtime})
        log.info("drafter exported to %s (final %s)", out, {k: round(v, 4) for k, v in last.items()})

    def speculators_copy(self, drafter: Eagle3Drafter, sglang_dir: Path) -> list[Path]:
        """drafter-speculators/ beside the SGLang dir, or none (a warning says why; an older one is removed)."""
        out = self.cfg.run_path / SPECULATORS_DIR
        why = drafter.config.speculators_refusal()
        if why:
            if out.exists():
                shutil.rmtree(out)
            log.warning("no %s/ (vLLM's speculators format) for %s", SPECULATORS_DIR, why)
            return []
        verifier = verifier_of(self.cfg)
        drafter.save_speculators(out, verifier, self.cfg.eval.draft_steps, sglang_dir / "model.safetensors")
        if verifier.name_or_path is None:
            log.warning("%s/: no verifier Hub id (set target.hub_id), so `vllm serve %s` alone is refused; "
                        "`vllm serve <target dir> --speculative-config '{\"model\": \"%s\"}'` serves it",
                        SPECULATORS_DIR, out, out)
        return [out]


def main(cfg: RunConfig, fresh: bool = False) -> Path:
    train_dir = cfg.run_path / "train"
    accelerator = make_accelerator(cfg, train_dir)
    data = cfg.run_path / ("hidden" if cfg.train.source == "offline" else "conversations")  # every rank reads it
    with stage_reader(data, "train"), stage_lock(train_dir, "train") if accelerator.is_main_process else nullcontext():
        return train(cfg, accelerator, train_dir, fresh)


def check_weight_precision(kernels: TrainKernels, accelerator: Accelerator) -> None:
    if kernels.bf16_weights and autocast_of(accelerator) != "bf16":
        raise UserError(f"train.kernels.bf16_weights = true needs bf16 training: train.mixed_precision resolved to "
                        f"{autocast_of(accelerator)!r} here; set train.mixed_precision=bf16 or "
                        "train.kernels.bf16_weights=false")
    if kernels.bf16_weights and accelerator.state.deepspeed_plugin is not None:
        raise UserError("train.kernels.bf16_weights = true: DeepSpeed keeps its own fp32 masters of bf16 weights; "
                        "set train.kernels.bf16_weights=false under DeepSpeed")


def train(cfg: RunConfig, accelerator: Accelerator, train_dir: Path, fresh: bool) -> Path:
    """A run's launch: its settings checked, the drafter built (or resumed), the epochs, the export."""
    options = check_run(cfg, accelerator)  # before any manifest is written: a corrected rerun needs no --fresh
    source = make_source(cfg, accelerator.device)
    settings, runtime = open_run(cfg, accelerator, source, fresh)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    built = build(cfg, accelerator, source, options)
    opt = make_optimizer([p for p in built.objective.parameters() if p.requires_grad], cfg.train)
    objective, opt, at, step_batches, accum = resume(cfg, accelerator, train_dir, built.objective, opt)
    if cfg.train.wandb_mode != "disabled":  # the mode travels with the run, not through a process-wide env var
        accelerator.init_trackers(cfg.train.wandb_project, config=to_dict(cfg), init_kwargs={
            "wandb": {"dir": str(train_dir), "name": cfg.name, "mode": cfg.train.wandb_mode}})
    export_at = exporter_of(accelerator, objective,
                            Exporter(cfg, source, built.coverage, settings, runtime, built.records))
    probe = TauProbe(cfg, source.model if cfg.train.source == "online" and cfg.train.tau_every else None)  # one copy
    f = Fit(cfg=cfg, accelerator=accelerator, objective=objective, opt=opt, source=source, ds=built.ds, probe=probe,
            head=built.head, train_dir=train_dir, step_batches=step_batches, accum=accum, export=export_at)
    step, stopped = fit(f, *at)
    if accelerator.device.type == "cuda":
        log.info("peak GPU memory of this process: %.2f GiB", torch.cuda.max_memory_allocated(accelerator.device) / 2**30)
    if stopped:
        log.info("stopped after %d steps of this launch (train.stop_after): rerun to continue from step %d, "
                 "on any number of processes", cfg.train.stop_after, step)
    else:
        export_at(step)  # before end_training: ZeRO-3 gathers the weights over the process group it ends
    accelerator.end_training()
    return cfg.run_path / "drafter"


def check_run(cfg: RunConfig, accelerator: Accelerator) -> StepOptions | None:
    """The settings' checks that need no data -> the EAGLE-3 step's options on this device (None for DFlash)."""
    tc = cfg.train
    check_weight_precision(tc.kernels, accelerator)
    if tc.drafter == "dflash":
        check_dflash_run(tc, accelerator)
        return None
    check_draft_vocab_size(tc.draft_vocab_size, target_info(cfg).vocab_size)
    dc = drafter_config(cfg, [], tc.draft_vocab_size)
    options = step_options(tc.kernels, accelerator.device, dc)
    if options.attention == "merged":  # its gradients against the dense path's, on this device
        check_merged_attention(accelerator.device, mla=dc.mla is not None)
    return options


@dataclass
class Built:
    """What a launch trains: the objective around the drafter, its teacher head, the dataset, and the records
    the export writes beside the weights (draft-token counts, trained prompts) with the draft vocab's coverage."""
    objective: torch.nn.Module
    head: TeacherHead
    ds: object
    records: dict[str, dict]
    coverage: float


def build(cfg: RunConfig, accelerator: Accelerator, source, options: StepOptions | None) -> Built:
    """The draft vocab from the data's assistant tokens, the drafter on the target's embedding and head."""
    tc, dflash = cfg.train, cfg.train.drafter == "dflash"
    target = load_target_embeddings(cfg)
    prompts: set[str] = set()
    counts = token_counts(trained_prompts.collect(source.token_pairs(), prompts), target.embed.shape[0])
    # DFlash reads the target's own LM head: its "draft vocab" is the whole vocab
    draft_ids, t2d, coverage = build_draft_vocab(counts, counts.numel() if dflash else tc.draft_vocab_size)
    log.info("%d samples / %d tokens (train.source=%s); draft vocab %d covers %.2f%% of assistant tokens",
             len(source.ids), source.num_tokens(), tc.source, draft_ids.numel(), 100 * coverage)
    if dflash:
        drafter, head = build_dflash(cfg, accelerator, source, target)
        objective = DFlashObjective(drafter, tc.loss_decay, tc.dflash.anchors, cfg.seed, tc.kernels.loss_chunk,
                                    head_loss(tc))
    else:
        drafter = build_drafter(cfg, source.compat["aux_layers"], draft_ids, t2d, target)
        head = ready_drafter(cfg, accelerator, drafter, source, target.lm_head[draft_ids], t2d)
        objective = TTTObjective(drafter, tc.ttt_steps, tc.loss_decay, options, head_loss(tc))
    records = {COUNTS_FILE: counts_record(draft_ids, counts[draft_ids], "assistant tokens of the training samples"),
               trained_prompts.FILE: trained_prompts.record(prompts)}
    return Built(objective, head, source.dataset(target, head.draft_head.dtype, tc.loss_on_prompt), records, coverage)


def head_loss(tc: TrainConfig) -> HeadLoss:
    return HeadLoss(tc.loss, tc.lk_kl_scale, tc.lk_kl_decay)


def resume(cfg: RunConfig, accelerator: Accelerator, train_dir: Path, objective, opt):
    """Prepared for this launch's processes (DeepSpeed configured first), from the latest checkpoint if any ->
    (objective, opt, (step, epoch, samples of the epoch done), the run's batches per step, this launch's accum)."""
    ckpt_root = train_dir / "checkpoints"
    latest = read_latest(accelerator, ckpt_root)
    step_batches, accum = batches_per_step(accelerator, latest, cfg.train)
    configure_deepspeed(accelerator, cfg.train, accum, autocast_of(accelerator))  # before prepare builds the engine
    objective, opt = accelerator.prepare(objective, opt)
    register_external_weights(accelerator.unwrap_model(objective), accelerator)
    logs = [train_dir / "metrics.jsonl", train_dir / "samples.jsonl", train_dir / "throughput.jsonl"]
    if not latest:
        trim_logs(accelerator, logs, 0)
        return objective, opt, (0, 0, 0), step_batches, accum
    load_checkpoint(accelerator, ckpt_root, latest, logs)
    return objective, opt, (latest["step"], latest["epoch"], latest["epoch_samples"]), step_batches, accum


def exporter_of(accelerator: Accelerator, objective, exporter: Exporter):
    """-> export_at(step, epoch=None): every rank calls it (ZeRO-3 gathers the weights from all of them); the main
    process writes."""
    def export_at(step: int, epoch: int | None = None) -> None:
        state, drafter = full_state_dict(accelerator, objective), accelerator.unwrap_model(objective).drafter
        if not accelerator.is_main_process:
            return
        if state is not None:  # ZeRO-3: this rank's module holds its partition only
            drafter = Eagle3Drafter(drafter.config)
            drafter.load_state_dict(state)
        exporter(drafter, step, epoch)

    return export_at


def check_dflash_run(tc: TrainConfig, accelerator: Accelerator) -> None:
    if accelerator.state.deepspeed_plugin is not None:
        raise UserError("train.drafter = dflash under DeepSpeed: not supported yet; launch with plain Accelerate "
                        "(scripts/accelerate/multi_gpu.yaml) or torchrun")
    if tc.kernels.bf16_weights:
        raise UserError("train.drafter = dflash with train.kernels.bf16_weights: not supported; set it to false")


def build_dflash(cfg: RunConfig, accelerator: Accelerator, source, target: TargetHead):
    """-> (the DFlash drafter, its teacher head: the target's whole LM head), its aux preconditioner from the data."""
    tc, info = cfg.train, target_info(cfg)
    mask_id = tc.dflash.mask_token_id if tc.dflash.mask_token_id >= 0 else info.vocab_size - 1
    config = DFlashConfig.for_target(read_target_config(info.path), source.compat["aux_layers"], tc.dflash.layers,
                                     tc.dflash.block_size, mask_id)
    drafter = DFlashDrafter(config, target.embed, target.lm_head)
    if target.final_norm is not None and tc.init_lm_head_from_target:  # the target's own final norm, as EAGLE's
        with torch.no_grad():
            drafter.norm.weight.copy_(target.final_norm)
    raw_rms, fc_input_rms = aux_rms(source.aux_samples(), str(source.dir), None)
    with torch.no_grad():
        drafter.aux_scale.copy_(fc_input_rms)
    matmul_dtype = torch.bfloat16 if autocast_of(accelerator) == "bf16" else torch.float32
    drafter.embed, drafter.lm_head = drafter.embed.to(matmul_dtype), drafter.lm_head.to(matmul_dtype)  # frozen: no
    device = accelerator.device  # fp32 copy to cast on every step under bf16
    head = TeacherHead(target.lm_head.to(device, matmul_dtype), torch.ones(info.vocab_size, dtype=torch.bool,
                                                                            device=device), raw_rms.to(device))
    return drafter, head


def ready_drafter(cfg: RunConfig, accelerator: Accelerator, drafter: Eagle3Drafter, source, draft_rows: torch.Tensor,
                  t2d: torch.Tensor) -> TeacherHead:
    """The drafter's aux preconditioner from the data, its weights in the precision they train in; -> the
    teacher's head on the device. draft_rows [Vd,H]: the target lm_head's rows of the draft vocab."""
    # per aux feature: the raw RMS is train.aux_noise's unit; the preconditioner is fc's input's (core/drafters/drafter.py)
    normed = drafter.config.norm_before_fc or drafter.config.fc_norm
    raw_rms, fc_input_rms = aux_rms(source.aux_samples(), str(source.dir), drafter.fc_input if normed else None)
    with torch.no_grad():
        drafter.aux_scale.copy_(fc_input_rms)
    precision = autocast_of(accelerator)
    frozen_to_matmul_dtype(drafter, precision)
    if cfg.train.kernels.bf16_weights:
        weights_to_bf16(drafter)
    matmul_dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # bf16 is ~2.7x faster where native
    device = accelerator.device
    return TeacherHead(draft_rows.to(device, matmul_dtype), t2d.to(device), raw_rms.to(device))


def batches_per_step(accelerator: Accelerator, latest: dict | None, tc: TrainConfig) -> tuple[int, int]:
    """-> (the run's batches per optimizer step, fixed at its first launch; this launch's micro-batches per rank)."""
    world = accelerator.num_processes
    step_batches = latest["step_batches"] if latest else world * tc.grad_accum
    accelerator.gradient_accumulation_steps = accum = accum_for(step_batches, world)
    if accum * world != step_batches:
        log.warning("this run's optimizer steps take %d batches, which %d processes cannot split: a step takes %d "
                    "(grad_accum %d) and the learning-rate schedule continues by samples", step_batches, world,
                    accum * world, accum)
    return step_batches, accum
