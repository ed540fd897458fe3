"""The optimizer-step loop: epochs of slots (train/position.py), accumulation, learning rate, logs, checkpoints.

Called by train.loop.train (`python -m train ...`) with the model and optimizer prepared and, when
resuming, the checkpoint loaded. Per step, in order: the micro-batches, the optimizer step, τ where due
(train/tau_probe.py), the log line (.item() only there), the checkpoint, the stop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm

from core.run.config import RunConfig
from core.run.errors import UserError
from core.storage.atomic_io import append_jsonl
from train.checkpoint import LATEST, save_checkpoint
from train.data import length_grouped_batches, slot_batches
from train.packing import pack
from train.position import Slot, batch_generator, batches_done, lr_factor, rank_slots, steps_left
from train.tau_probe import TauProbe
from train.ttt_loss import step_metrics, teacher_targets


class TeacherHead(NamedTuple):
    """On the device: the target lm_head's rows of the draft vocab [Vd,H] (the teacher's), t2d [V], and each raw
    aux feature's RMS [3H] (train.aux_noise's unit)."""
    draft_head: torch.Tensor
    t2d: torch.Tensor
    raw_rms: torch.Tensor


@dataclass
class Fit:
    """What the loop reads, built once per launch, and the few things it moves on."""
    cfg: RunConfig
    accelerator: Accelerator
    objective: torch.nn.Module  # prepared TTTObjective
    opt: torch.optim.Optimizer  # prepared
    source: object  # ShardSource | OnlineSource (train/data.py): ds's samples, lengths, complete(batch), where(ids)
    ds: torch.utils.data.Dataset  # source.dataset(...)
    probe: TauProbe
    head: TeacherHead
    train_dir: Path
    step_batches: int  # batches per optimizer step at the run's first launch
    accum: int  # micro-batches per rank per step in this launch
    export: Callable[[int, int], None]  # (step, epoch): train.loop.Exporter on the drafter after that epoch, rank 0
    window: dict | None = None  # per-step metric sums since the last log line
    pace: "Pace" = None  # tokens and wall time since the last log line
    records: list = field(default_factory=list)  # train.log_samples rows of this step, this rank

    def order(self, epoch: int) -> list[list[int]]:
        return length_grouped_batches(self.source.lengths, self.cfg.train.batch_size, self.cfg.seed + epoch)


def stop_if_not_finite(x: torch.Tensor, what: str, step: int, epoch: int, ids: list[str], source):
    """Training on NaN/inf silently ruins every weight: stop at the first, naming the batch's samples."""
    if not torch.isfinite(x).all():
        raise UserError(f"non-finite {what} ({x.item()}) at step {step} (epoch {epoch}) on samples {ids} of "
                        f"{source.where(ids)}: check those samples, or lower train.lr; nothing was exported")


def batch_loss(f: Fit, batch: dict, epoch: int, index: int, step: int):
    """The TTT loss of batch `index` of the epoch's order -> (loss, metric sums)."""
    tc = f.cfg.train
    draft_head, t2d, raw_rms = f.head
    batch = f.source.complete(batch)  # online: the target's captures of this batch
    aux = batch["aux"]
    if tc.aux_noise:  # in units of each raw aux feature's RMS, drawn from the batch's own stream
        g = batch_generator(f.cfg.seed, epoch, index, aux.device)
        noise = torch.rand(aux.shape, generator=g, device=aux.device, dtype=aux.dtype)
        batch = {**batch, "aux": aux + (noise * 2 - 1) * tc.aux_noise * raw_rms}
    if tc.kernels.pack_length:  # after the noise, drawn as for the padded batch: packing changes the layout only
        batch = pack(batch, tc.kernels.pack_length)
    mask = batch["valid"] if tc.loss_on_prompt else batch["loss_mask"]
    doc_ids, positions = batch.get("doc_ids"), batch.get("positions")  # packed rows only
    teacher = teacher_targets(batch["final"], mask, draft_head, t2d, batch["argmax"], doc_ids, batch["teacher_lse"])
    draws = batch_generator(f.cfg.seed, epoch, index, torch.device("cpu"))  # DFlash's anchors: a resume redraws them
    loss, m = f.objective(batch["aux"], batch["input_ids"], mask, teacher, doc_ids, positions, generator=draws)
    stop_if_not_finite(loss, "loss", step + 1, epoch, batch["ids"], f.source)
    return loss, m


def micro_step(f: Fit, batch: dict, slot: Slot, epoch: int, step: int, lr: float) -> None:
    """Forward and backward of one slot; on a step's last slot also the optimizer step, at learning rate lr."""
    tc, accelerator = f.cfg.train, f.accelerator
    with accelerator.accumulate(f.objective):
        if accelerator.sync_gradients:  # set before the backward: under DeepSpeed the step happens inside it
            for group in f.opt.param_groups:
                group["lr"] = lr
        loss, m = batch_loss(f, batch, epoch, slot.batch, step)
        if not slot.weight:  # an empty slot at the epoch's end: it trains and counts nothing
            m = {k: v * 0 for k, v in m.items()}
        elif tc.log_samples:
            f.records.append({"epoch": epoch, "batch": slot.batch, "rank": accelerator.process_index,
                              "ids": batch["ids"], "loss": loss.item()})
        f.window = m if f.window is None else {k: f.window[k] + v for k, v in m.items()}
        accelerator.backward(loss * slot.weight)
        if accelerator.sync_gradients:
            # DeepSpeed clips inside its step (gradient_clipping = train.grad_clip, train/deepspeed_config.py) and
            # returns that step's norm as a float
            norm = accelerator.clip_grad_norm_(f.objective.parameters(), tc.grad_clip)
            if norm is not None:
                stop_if_not_finite(torch.as_tensor(norm), "gradient norm", step + 1, epoch, batch["ids"], f.source)
        f.opt.step()
        f.opt.zero_grad(set_to_none=True)


def log_samples(f: Fit, step: int) -> None:
    """train.log_samples: every rank's micro-batches of this step (ids, loss) -> samples.jsonl."""
    rows = gather_object(f.records) if f.accelerator.num_processes > 1 else f.records
    if f.accelerator.is_main_process:
        append_jsonl(f.train_dir / "samples.jsonl", [{"step": step, **r} for r in sorted(rows, key=lambda r: r["batch"])])
    f.records = []


class Pace:
    """The run's speed between log lines: this rank's tokens (the samples' lengths, no device sync) and the wall
    time, everything a step costs included (reading, copies, step, optimizer, metrics); checkpoints and τ
    probes are left out. -> train/throughput.jsonl (main process) and W&B, apart from metrics.jsonl, whose rows
    are the same on every machine."""

    def __init__(self):
        self.restart()

    def restart(self):
        self.tokens, self.start, self.excluded = 0, time.perf_counter(), 0.0

    @contextmanager
    def paused(self):
        """What runs inside (a checkpoint, a τ probe, an epoch's export) is not the loop's time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    def log(self, f: Fit, step: int) -> float:
        """Write the window's row and start the next window."""
        seconds = time.perf_counter() - self.start - self.excluded
        tokens = int(f.accelerator.reduce(torch.tensor(self.tokens, device=f.accelerator.device), "sum"))
        row = {"step": step, "tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
        if f.accelerator.device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(f.accelerator.device) / 2**30, 2)
        f.accelerator.log({"tokens_per_s": row["tokens_per_s"]}, step=step)
        if f.accelerator.is_main_process:
            append_jsonl(f.train_dir / "throughput.jsonl", [row])
        self.restart()
        return row["tokens_per_s"]


def log_metrics(f: Fit, row: dict) -> dict:
    """row ({"step", "epoch", "samples", "lr"}, τ where measured) + the per-step sums since the last line,
    summed across ranks, then divided (step_metrics)."""
    sums = {k: f.accelerator.reduce(v, "sum") for k, v in f.window.items()}
    row = {**row, **step_metrics(sums, f.cfg.train.loss_decay)}
    f.accelerator.log(row, step=row["step"])
    if f.accelerator.is_main_process:
        append_jsonl(f.train_dir / "metrics.jsonl", [row])
    f.window = None
    return row


def fit(f: Fit, step: int, start_epoch: int, epoch_samples: int) -> tuple[int, bool]:
    """Train from `epoch_samples` samples into `start_epoch` (step `step` done) to the end of the run, or
    for train.stop_after steps -> (steps done, stopped early)."""
    tc, accelerator = f.cfg.train, f.accelerator
    world, rank, n = accelerator.num_processes, accelerator.process_index, len(f.ds)
    total, where = tc.epochs * n, str(f.train_dir / "checkpoints" / LATEST)
    first = f.order(start_epoch)
    end_step = step + steps_left(len(first), batches_done(first, epoch_samples, where), world * f.accum,
                                 tc.epochs - start_epoch)
    first_step, stopped = step, False
    f.pace = Pace()
    bar = tqdm(total=end_step, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    for epoch in range(start_epoch, tc.epochs):
        batches = f.order(epoch)
        done = batches_done(batches, epoch_samples, where)
        epoch_samples = 0
        seen = [epoch * n + k for k in itertools.accumulate(map(len, batches), initial=0)]  # run's samples at batch i
        slots = rank_slots(len(batches), done, world, f.accum, rank)
        for slot, batch in zip(slots, slot_batches(f.ds, batches, slots, accelerator.device), strict=True):
            lr = tc.lr * lr_factor(seen[slot.start], seen[slot.end], total, tc.warmup_ratio * total)
            micro_step(f, batch, slot, epoch, step, lr)
            f.pace.tokens += sum(f.source.lengths[i] for i in batches[slot.batch]) if slot.weight else 0
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if tc.log_samples:
                log_samples(f, step)
            measure_tau = f.probe.due(step, end_step)
            if step % tc.log_every == 0 or step == end_step or measure_tau:  # .item() (a sync) only here
                row = {"step": step, "epoch": epoch, "samples": seen[slot.end], "lr": lr}
                tokens_per_s = f.pace.log(f, step)
                with f.pace.paused():
                    tau = f.probe.measure(accelerator, f.objective) if measure_tau else {}
                row = log_metrics(f, {**row, **tau})
                bar.set_postfix({**{k: f"{row[k]:.3f}" for k in ("loss", "acc_0", "tau") if k in row},
                                 "tok/s": f"{tokens_per_s:,.0f}"})
            stopped = step - first_step == tc.stop_after and step < end_step  # at the end: export
            if (tc.save_every and step % tc.save_every == 0) or stopped:
                with f.pace.paused():
                    save_checkpoint(accelerator, f.train_dir / "checkpoints", {
                        "step": step, "epoch": epoch, "epoch_samples": seen[slot.end] - epoch * n,
                        "step_batches": f.step_batches})
            if stopped:
                break
        if stopped:
            break
        with f.pace.paused():
            if not tc.save_every:
                save_checkpoint(accelerator, f.train_dir / "checkpoints", {
                    "step": step, "epoch": epoch + 1, "epoch_samples": 0, "step_batches": f.step_batches})
            if tc.epoch_drafters and epoch + 1 < tc.epochs:  # the last epoch's is drafter/
                f.export(step, epoch + 1)  # every rank: ZeRO-3 gathers the weights; the main process writes
                accelerator.wait_for_everyone()
    bar.close()
    return step, stopped
