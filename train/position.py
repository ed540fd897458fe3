"""Where a run is in its data and its schedule, counted so that any number of processes can continue it.

An epoch's order is a list of batches (`length_grouped_batches` of the seed, the epoch and
train.batch_size), the same list on any world size. An optimizer step trains the next world x accum
batches of it: micro-step a of rank r takes batch p + a*world + r, p being the batches done. A
checkpoint records the samples done in the epoch; a launch on another world size maps them back to
p, so within an epoch no sample is lost or trained twice.

The last step of an epoch may find fewer batches left than slots: an empty slot runs the step's
first batch with weight 0 (under DDP every rank joins every all-reduce) and the real slots weigh
world x accum / real, so that step's gradient is the mean over its batches, like every other step's.

The learning rate is a function of the samples the run has done (warmup, then cosine to 0 over
epochs x samples): a step of another size continues the same curve. With steps of equal size it is
the per-step schedule: step k (0-based) of w warmup steps gets (k+1)/w, then the cosine at k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.run.errors import UserError


@dataclass(frozen=True)
class Slot:
    batch: int  # index in the epoch's batch list (an empty slot repeats its step's first batch)
    weight: float  # loss weight: 0 for an empty slot
    start: int  # batches of the epoch done before this slot's step
    end: int  # ... and after it


def rank_slots(num_batches: int, done: int, world: int, accum: int, rank: int) -> list[Slot]:
    """This rank's micro-batches for the rest of the epoch, `accum` per optimizer step."""
    slots, per_step = [], world * accum
    for start in range(done, num_batches, per_step):
        end = min(start + per_step, num_batches)
        for a in range(accum):
            i = start + a * world + rank
            slots.append(Slot(i, per_step / (end - start), start, end) if i < end else Slot(start, 0.0, start, end))
    return slots


def steps_left(num_batches: int, done: int, per_step: int, epochs: int) -> int:
    """Optimizer steps from `done` batches into this epoch to the end of `epochs` epochs (this one included)."""
    if epochs <= 0:
        return 0
    return math.ceil((num_batches - done) / per_step) + (epochs - 1) * math.ceil(num_batches / per_step)


def batches_done(batches: list[list[int]], samples: int, where: str) -> int:
    """The number of leading batches of the epoch's order that hold `samples` samples."""
    done, n = 0, 0
    while n < samples and done < len(batches):
        n, done = n + len(batches[done]), done + 1
    if n != samples:
        raise UserError(f"{where}: {samples} samples done in the epoch is not a batch boundary of its order "
                        f"(batches of {[len(b) for b in batches[:done + 1]]}...): the checkpoint was not written "
                        "for this data and train.batch_size; pass --fresh")
    return done


def accum_for(step_batches: int, world: int) -> int:
    """Micro-batches per rank per step on `world` processes for a run whose steps take `step_batches`
    batches (world x grad_accum at its first launch): the same global batch where world divides it
    (2 -> 1 process doubles the accumulation), else the smallest step at least that large."""
    return max(1, math.ceil(step_batches / world))


def lr_factor(before: int, after: int, total: int, warmup: float) -> float:
    """Multiplier of train.lr for a step that takes the run from `before` to `after` samples done, of
    `total` (= epochs x samples), with `warmup` samples of linear warmup (train.warmup_ratio x total)."""
    if before < warmup:
        return min(1.0, after / warmup)
    progress = (before - warmup) / max(1.0, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def batch_generator(seed: int, epoch: int, batch: int, device: torch.device) -> torch.Generator:
    """The random stream of one batch of one epoch (aux noise): the same on whichever rank, in whichever
    launch, trains it, where per-rank RNG states saved by one world size mean nothing on another."""
    return torch.Generator(device=device).manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + batch) % 2**63)
