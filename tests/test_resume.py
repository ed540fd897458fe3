"""kill -9 in the middle of data_gen / extract / train, rerun: nothing lost, nothing duplicated; a
training run stopped on 2 processes and finished on 1, and the reverse. Uses the tiny random target
so each stage runs for seconds."""

import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.storage.conversations import read_conversations
from core.storage.hidden_shards import INDEX, HiddenShards
from core.storage.stage_lock import LOCK_FILE
from tests.conftest import ROOT, run_stage


def kill_when(args: list[str], ready, timeout: float = 300) -> None:
    """Start `python -m args`, SIGKILL it as soon as ready() holds (or fail if it finishes first)."""
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"{args[0]} finished before it could be killed"
        assert time.time() < deadline, f"{args[0]} never reached the kill point"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def flags(run_dir: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny-random-llama.yaml", "--run-dir", str(run_dir), *extra]


def test_kill_9_mid_stage_then_rerun(tmp_path):
    run_dir = tmp_path / "run"
    conv = run_dir / "conversations"
    f = flags(run_dir, "data_gen.num_samples=16", "data_gen.part_samples=2", "data_gen.batch_size=2",
              "extract.shard_mb=0", "extract.batch_tokens=64")
    kill_when(["data_gen", *f], lambda: len(list(conv.glob("part-*.parquet"))) >= 2)
    partial = read_conversations(conv)["id"]
    assert 0 < len(partial) < 16
    run_stage("data_gen", *f)
    ids = read_conversations(conv)["id"]
    assert len(ids) == 16 and len(set(ids)) == 16 and set(partial) <= set(ids)

    index = run_dir / "hidden" / INDEX
    kill_when(["extract", *f], lambda: index.exists() and index.read_text().count("\n") >= 3)
    done = len(HiddenShards(run_dir / "hidden"))
    assert 0 < done < 16
    run_stage("extract", *f)
    shards = HiddenShards(run_dir / "hidden")
    rows = [json.loads(x) for x in index.read_text().splitlines()]
    assert sorted(shards.ids) == sorted(ids) and len(rows) == 16  # every sample once

    # The same training uninterrupted, on a copy of the same shards: the reference for the resumed run.
    ref_dir = tmp_path / "ref"
    for stage_dir in ("conversations", "hidden"):
        shutil.copytree(run_dir / stage_dir, ref_dir / stage_dir)
    tf = ["train.epochs=3", "train.batch_size=2", "train.save_every=2", "train.log_every=1", "train.lr=3e-3"]
    run_stage("train", *flags(ref_dir, *tf))
    rows = [json.loads(x) for x in (ref_dir / "train/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 25)) and all(math.isfinite(x) for x in losses)
    # Training makes progress: each epoch sees the same 16 samples, so without learning the epoch
    # means would be equal.
    first, last = (sum(losses[e * 8:(e + 1) * 8]) / 8 for e in (0, 2))
    assert last < 0.97 * first, f"epoch-mean loss {first:.4f} -> {last:.4f}: training is not learning"

    ckpt = run_dir / "train/checkpoints/latest.json"
    kill_when(["train", *flags(run_dir, *tf)], lambda: ckpt.exists() and json.loads(ckpt.read_text())["step"] >= 4)
    step = json.loads(ckpt.read_text())["step"]
    assert step < 24
    log = run_stage("train", *flags(run_dir, *tf)).stderr
    assert f"resumed from step-{step:07d}" in log
    assert json.loads(ckpt.read_text())["step"] == 24  # 16 samples / 2 per step x 3 epochs
    metrics = [json.loads(x)["step"] for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(1, 25))
    # Resumed == uninterrupted: the same weights, not just the same step counter.
    resumed, reference = (load_file(str(d / "drafter/model.safetensors")) for d in (run_dir, ref_dir))
    assert resumed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after resuming at step {step}"


# Resuming onto another number of processes (issue 13): `accelerate launch --multi_gpu` on CPU is one gloo group.
# Batches of 5 from 12 samples: 5, 5, 2 per epoch, a short batch (samples done != batches x 5) and an odd
# count (two processes end every epoch with an empty slot). aux_noise: its draws must follow the batch, not
# the process. log_samples: train/samples.jsonl names each micro-batch's samples and loss.
WORLD_TRAIN = ["train.batch_size=5", "train.epochs=3", "train.lr=3e-3", "train.aux_noise=0.1",
               "train.log_samples=true", "train.wandb_mode=disabled"]


@pytest.fixture
def shards(overfit_tiny, tmp_path):
    """-> new_run(name): a run dir holding a copy of the tiny run's conversations and hidden shards."""
    src = overfit_tiny[1]

    def new_run(name: str) -> Path:
        for stage_dir in ("conversations", "hidden"):
            shutil.copytree(src / stage_dir, tmp_path / name / stage_dir, ignore=shutil.ignore_patterns(LOCK_FILE))
        return tmp_path / name
    return new_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on(processes: int, run_dir: Path, *extra: str, torchrun: bool = False) -> str:
    """`python -m train` (1: in this process, conftest.run_stage), `accelerate launch --multi_gpu --num_processes
    N -m train` or `torchrun --nproc_per_node N -m train` -> its stderr."""
    if processes == 1:
        return run_stage("train", *flags(run_dir, *WORLD_TRAIN, *extra)).stderr
    bin_dir = Path(sys.executable).parent
    port = str(free_port())  # not the launchers' shared default 29500, which another run may still hold
    launcher = [str(bin_dir / "torchrun"), "--nproc_per_node", str(processes), "--master_port", port] if torchrun else [
        str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    proc = subprocess.run([*launcher, "-m", "train", *flags(run_dir, *WORLD_TRAIN, *extra)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_each_sample_once_per_epoch(run_dir: Path) -> list[dict]:
    """Every sample of the shards is trained exactly once in each of the 3 epochs -> samples.jsonl's rows."""
    rows = jsonl(run_dir / "train/samples.jsonl")
    everyone = sorted(HiddenShards(run_dir / "hidden").ids)
    for epoch in range(3):
        ids = sorted(i for r in rows if r["epoch"] == epoch for i in r["ids"])
        assert ids == everyone, f"epoch {epoch} trained {ids}, not each of {everyone} once"
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch path")
def test_two_processes_stop_and_one_process_finishes_as_if_never_stopped(shards):
    """The uninterrupted reference is one process accumulating two batches a step (train.grad_accum=2): the global
    batch of two processes, each step's two batches the ones the two ranks take, so it trains what an uninterrupted
    two-process run trains (the comment below: the same sum, exact in binary floating point)."""
    ref, run = shards("ref"), shards("run")
    train_on(1, ref, "train.grad_accum=2")
    # epoch 0 is 2 steps ([b0 b1], [b2 + empty]): stops inside epoch 1
    train_on(2, run, "train.stop_after=3", "train.wandb_mode=offline")
    # rank 0 alone logs: one W&B run, each step's metrics once (checked below), not one run per process
    assert len(list((run / "train/wandb").glob("offline-run-*"))) == 1
    latest = json.loads((run / "train/checkpoints/latest.json").read_text())
    assert (latest["step"], latest["epoch"], latest["world_size"], latest["step_batches"]) == (3, 1, 2, 2)
    assert not (run / "drafter").exists()  # a stopped launch exports nothing
    log = train_on(1, run)
    assert "resumed from step-0000003" in log and "written by 2 process(es), now 1" in log
    rows, ref_rows = assert_each_sample_once_per_epoch(run), jsonl(ref / "train/samples.jsonl")
    # One process accumulates the two batches the two ranks took (grad_accum 1 -> 2 keeps the run's global batch),
    # so the run goes on exactly as the uninterrupted one: the same batches per step, the same losses. Both
    # average the same two gradients ((g0 + g1) / 2 all-reduced = g0 / 2 + g1 / 2 accumulated, exact in binary
    # floating point), so on this CPU the weights are equal to the bit; the tolerances leave room for another
    # machine's summation order, and a resume that lost the weights, the optimizer state, the accumulation or
    # the noise stream misses them by orders of magnitude.
    strip = [{k: v for k, v in r.items() if k not in ("rank", "loss")} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k not in ("rank", "loss")} for r in ref_rows]
    for r, want in zip(rows, ref_rows, strict=True):
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-5), (r, want)
    metrics, ref_metrics = jsonl(run / "train/metrics.jsonl"), jsonl(ref / "train/metrics.jsonl")
    assert [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == list(range(1, 7))
    for m, want in zip(metrics[3:], ref_metrics[3:], strict=True):
        assert m["lr"] == want["lr"] and m["samples"] == want["samples"]
        assert m["loss"] == pytest.approx(want["loss"], rel=1e-5), (m, want)
    resumed, reference = (load_file(str(d / "drafter/model.safetensors")) for d in (run, ref))
    for name, tensor in reference.items():
        assert torch.allclose(resumed[name].float(), tensor.float(), rtol=0, atol=1e-5), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch path")
def test_one_process_stop_and_two_processes_finish_every_sample_once(shards):
    ref, run = shards("ref"), shards("run")
    train_on(1, ref)
    train_on(1, run, "train.stop_after=4")  # 3 steps per epoch: stops after batch 0 of epoch 1, an odd position
    log = train_on(2, run, torchrun=True)  # torchrun's CPU processes train as one gloo group too (issue 11 item 6)
    assert "resumed from step-0000004" in log and "written by 1 process(es), now 2" in log
    runtime = json.loads((run / "train/manifest.json").read_text())["runtime"]
    assert runtime["world_size"] == 2 and runtime["distributed"].endswith("MULTI_CPU") and "world size 2" in log
    assert "which 2 processes cannot split" in log  # one batch per step can't be split: steps take two now
    rows, ref_rows = assert_each_sample_once_per_epoch(run), jsonl(ref / "train/samples.jsonl")
    # Steps 5-7: [b1 b2] of epoch 1, then [b0 b1], [b2 + empty] of epoch 2; every batch in the run's order.
    assert [(r["step"], r["epoch"], r["batch"]) for r in rows[4:]] == [
        (5, 1, 1), (5, 1, 2), (6, 2, 0), (6, 2, 1), (7, 2, 2)]
    assert [(r["epoch"], r["batch"], r["ids"]) for r in rows] == [(r["epoch"], r["batch"], r["ids"]) for r in ref_rows]
    # The first batch after the resume meets the weights the uninterrupted run had there (same batch, same
    # noise): the same loss up to float noise. Past it the runs part ways: two processes take one step per two
    # batches, half as many updates at the same per-sample learning rate, and lag the one-process run by a few
    # percent (measured: +2% on the mean, at most +5% per batch); a resume that lost the weights sits at the
    # untrained loss, +60%. 10% tells the two apart.
    assert rows[4]["loss"] == pytest.approx(ref_rows[4]["loss"], rel=1e-5)
    after, ref_after = (sum(r["loss"] for r in x[4:]) / len(x[4:]) for x in (rows, ref_rows))
    assert after == pytest.approx(ref_after, rel=0.10), (after, ref_after)
    metrics, ref_metrics = jsonl(run / "train/metrics.jsonl"), jsonl(ref / "train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 8))
    # The learning rate follows samples done: it goes on down the same curve and ends where the reference ends.
    assert metrics[:4] == ref_metrics[:4]
    assert metrics[4]["samples"] == 24 and metrics[-1]["samples"] == 36  # the end of epochs 1 and 2
    assert metrics[-1]["lr"] == ref_metrics[-1]["lr"] and all(a["lr"] >= b["lr"] for a, b in pairwise(metrics))


def test_rank_slots_split_the_rest_of_an_epoch_once_over_any_world_size():
    from train.position import lr_factor, rank_slots

    for batches, world, accum in itertools.product(range(1, 8), range(1, 4), range(1, 4)):
        for done in range(batches + 1):
            per_rank = [rank_slots(batches, done, world, accum, r) for r in range(world)]
            assert len({len(s) for s in per_rank}) == 1  # under DDP every rank joins every step
            real = sorted(s.batch for slots in per_rank for s in slots if s.weight)
            assert real == list(range(done, batches)), (batches, done, world, accum, real)
            # a step's real batches weigh world x accum in all (their mean gradient, like a full step's)
            for k in range(0, len(per_rank[0]), accum):
                step = [s for slots in per_rank for s in slots[k:k + accum]]
                assert sum(s.weight for s in step) == pytest.approx(world * accum)
                assert len({(s.start, s.end) for s in step}) == 1
    # With steps of equal size the per-sample schedule is the old per-step one: (k+1)/w, then cosine at k.
    total, n, warm = 40, 4, 2  # 10 steps of 4 samples, 2 warmup steps
    old = [(k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (10 - warm))) for k in range(10)]
    assert [lr_factor(k * n, (k + 1) * n, total, warm * n) for k in range(10)] == pytest.approx(old)


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    """kill -9 after some logged steps but before the first checkpoint: the rerun starts over at step 0, and
    metrics.jsonl (so curves.png) holds each step once, not the killed run's steps and then the same again."""
    run_dir = tmp_path / "run"
    f = flags(run_dir, "data_gen.num_samples=8", "train.epochs=2", "train.batch_size=2", "train.log_every=1",
              "train.save_every=1000")
    for stage in ("data_gen", "extract"):
        run_stage(stage, *f)
    metrics = run_dir / "train/metrics.jsonl"
    kill_when(["train", *f], lambda: metrics.exists() and metrics.read_text().count("\n") >= 2)
    assert not (run_dir / "train/checkpoints/latest.json").exists()
    run_stage("train", *f)
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
