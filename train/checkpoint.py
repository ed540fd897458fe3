"""Checkpoints: Accelerate's save_state (weights, AdamW state) plus latest.json, the run's place in its data.

latest.json: {"path", "step", "epoch", "epoch_samples": samples of the epoch's order done,
"step_batches": batches per optimizer step at the run's first launch (world size x grad_accum),
"world_size": of the launch that wrote it}. None of it asks the reader to have that world size
(train/position.py). Weights and AdamW state are replicated under DDP, so rank 0's files serve any
world size. The per-rank RNG files Accelerate writes are not needed: every random draw of training
is seeded by its place in the data. DeepSpeed ZeRO shards the optimizer state by rank, so there a
checkpoint resumes only on the world size that wrote it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from accelerate import Accelerator

from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_json, atomic_write_text, honour_umask, read_jsonl

log = logging.getLogger("train")
LATEST = "latest.json"


def save_checkpoint(accelerator: Accelerator, ckpt_root: Path, position: dict) -> None:
    """position: {"step", "epoch", "epoch_samples", "step_batches"}; keeps the two newest checkpoints."""
    path = ckpt_root / f"step-{position['step']:07d}"
    start = time.perf_counter()
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        honour_umask(path)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log.info("checkpoint %s: %.2f GiB in %.1f s", path.name, size / 2**30, time.perf_counter() - start)
        atomic_write_json(ckpt_root / LATEST, {"path": path.name, **position, "world_size": accelerator.num_processes})
        for old in sorted(ckpt_root.glob("step-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def read_latest(accelerator: Accelerator, ckpt_root: Path) -> dict | None:
    """latest.json, if a checkpoint was completed; refused where this launch cannot continue it."""
    path = ckpt_root / LATEST
    if not path.is_file():
        return None
    latest = json.loads(path.read_text())
    if "epoch_samples" not in latest:
        raise UserError(f"{path} was written by an older version (its position counts batches per process): "
                        "pass --fresh to train again")
    if accelerator.state.deepspeed_plugin is not None and latest["world_size"] != accelerator.num_processes:
        raise UserError(f"{path}: written by {latest['world_size']} processes under DeepSpeed, whose ZeRO optimizer "
                        f"state is sharded by rank; resume on {latest['world_size']} processes, or pass --fresh")
    return latest


def load_checkpoint(accelerator: Accelerator, ckpt_root: Path, latest: dict, logs: list[Path]) -> None:
    """Weights and optimizer state from `latest`; rows of `logs` after its step are dropped (they are redone)."""
    accelerator.load_state(str(ckpt_root / latest["path"]))
    accelerator.step = 0  # its micro-batch counter: checkpoints fall on whole steps, and accum may differ now
    log.info("resumed from %s (step %d, epoch %d, %d samples of the epoch done; written by %d process(es), "
             "now %d)", latest["path"], latest["step"], latest["epoch"], latest["epoch_samples"],
             latest["world_size"], accelerator.num_processes)
    trim_logs(accelerator, logs, latest["step"])


def trim_logs(accelerator: Accelerator, logs: list[Path], step: int) -> None:
    """Drop the rows of `logs` after `step`: a run resumed there (or started over, step 0, when it was killed
    before its first checkpoint) logs those steps again, and curves.png must not draw them twice."""
    if accelerator.is_main_process:
        for path in filter(Path.is_file, logs):
            kept = [r for r in read_jsonl(path) if r["step"] <= step]
            atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
