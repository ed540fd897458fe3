"""bench/bench_train_loop.py at tiny widths, run as a user runs it: the Kimi-K2.5-layout target and fp8 loss-span
shards written by extract's ShardWriter, `python -m train` on them, the step alone beside it, `loop / step` printed.
The GPU figures in docs/PERFORMANCE.md come from the same script at Kimi's real widths; this keeps it from rotting."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_train_loop_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "bench/bench_train_loop.py", "--smoke", "--work", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rec = json.loads(next(line for line in out.stdout.splitlines()
                          if line.startswith("RESULT") and '"train_loop"' in line)[len("RESULT "):])
    assert rec["samples"] == 6 and rec["tokens"] == 6 * 256
    assert rec["shard_mib"] > 0 and rec["disk_read_gbps"] > 0 and rec["loader_read_gbps"] > 0
    loop = rec["loop"]
    assert loop["steps_timed"] == 5 and loop["tokens_per_s"] > 0 and loop["checkpoint"]["name"] == "step-0000006"
    assert rec["step"]["tokens_per_s"] > 0 and rec["loop_over_step"] > 0
    assert "loop / step = " in out.stdout
    # the shards are extract's: fp8 with their scales, final rows on the loss spans only
    run = tmp_path / "run-gqa-256"
    manifest = json.loads((run / "hidden/manifest.json").read_text())
    assert manifest["compat"]["dtype"] == "fp8_e4m3" and manifest["compat"]["spans"] == "loss"
    assert (run / "drafter/model.safetensors").is_file()
    throughput = [json.loads(x) for x in (run / "train/throughput.jsonl").read_text().splitlines()]
    assert [r["step"] for r in throughput] == list(range(1, 7)) and all(r["tokens"] == 256 for r in throughput)
