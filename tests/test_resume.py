"""kill -9 in the middle of data_gen / extract / train, rerun: nothing lost, nothing duplicated.
Uses the tiny random target so each stage runs for seconds."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from core.conversations import read_conversations
from core.hidden_shards import INDEX, HiddenShards
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
