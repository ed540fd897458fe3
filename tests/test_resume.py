"""kill -9 in the middle of data_gen / extract / train, rerun: nothing lost, nothing duplicated.
Uses the tiny random target so each stage runs for seconds."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from core.conversations import read_conversations
from core.hidden_shards import INDEX, HiddenShards
from tests.conftest import ROOT, run_cli


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
    run_cli("data_gen", *f)
    ids = read_conversations(conv)["id"]
    assert len(ids) == 16 and len(set(ids)) == 16 and set(partial) <= set(ids)

    index = run_dir / "hidden" / INDEX
    kill_when(["extract", *f], lambda: index.exists() and index.read_text().count("\n") >= 3)
    done = len(HiddenShards(run_dir / "hidden"))
    assert 0 < done < 16
    run_cli("extract", *f)
    shards = HiddenShards(run_dir / "hidden")
    rows = [json.loads(x) for x in index.read_text().splitlines()]
    assert sorted(shards.ids) == sorted(ids) and len(rows) == 16  # every sample once

    ckpt = run_dir / "train/checkpoints/latest.json"
    tf = [*f, "train.epochs=3", "train.batch_size=2", "train.save_every=2", "eval.max_prompts=2"]
    kill_when(["train", *tf], lambda: ckpt.exists() and json.loads(ckpt.read_text())["step"] >= 4)
    step = json.loads(ckpt.read_text())["step"]
    log = run_cli("train", *tf).stderr
    assert f"resumed from step-{step:07d}" in log
    assert json.loads(ckpt.read_text())["step"] == 24  # 16 samples / 2 per step x 3 epochs
    metrics = [json.loads(x)["step"] for x in (run_dir / "train/metrics.jsonl").read_text().splitlines()]
    assert metrics[-1] == 24
    assert (run_dir / "drafter/model.safetensors").is_file()
