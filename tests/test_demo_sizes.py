"""`make demo` sizes itself to the machine (scripts/demo.py, run as users run it): the config's sizes on a fast CPU
with native bf16, MEDIUM on a slower one with native bf16, COMPACT_FAST / COMPACT without it by the fp32 rate
(valid config keys, smaller work, said aloud); the user's key=value arguments still win."""

import json
import subprocess
import sys

import pytest

from core.run.config import load_config
from tests.conftest import ROOT


def show_sizes(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/demo.py"), "--show-sizes", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gflops, precision, samples", [(290, "bf16", 1216), (125, "fp32", 448), (150, "fp32", 448), (165, "fp32", 768),
                                                        (290, "fp32", 768), (103, "bf16", 1024)])
def test_sizes_follow_the_machine(gflops, precision, samples):
    proc = show_sizes("--assume", f"{gflops},{precision}", "train.epochs=7")
    assert proc.returncode == 0, proc.stderr
    overrides = json.loads(proc.stdout.splitlines()[-1])
    compact = samples != 1216
    assert (f"{gflops} GFLOP/s" in proc.stdout) == compact  # smaller sizes are said aloud
    full = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [])
    small = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", overrides)
    work = small.data_gen.num_samples * small.eval.max_new_tokens * small.eval.max_prompts
    assert (work < full.data_gen.num_samples * full.eval.max_new_tokens * full.eval.max_prompts) == compact
    assert small.data_gen.num_samples == samples
    assert small.train.epochs == 7  # the user's override wins
    assert small.train.ttt_steps == (2 if precision == "fp32" else 3)  # fp32 tiers: K=2 buys ~1/4 of training
    # τ probes: about three over the run, whatever the sizes and batch (each costs ~30 s of a 2-core CPU)
    steps = -(-small.data_gen.num_samples // small.train.batch_size) * small.train.epochs
    assert small.train.tau_every == -(-steps // 3)


def test_a_malformed_assumption_is_one_line_and_exit_2():
    proc = show_sizes("--assume", "12x,fp32")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "demo: error: --assume '12x,fp32': expected GFLOPS,bf16 or GFLOPS,fp32 (e.g. 125,fp32)")
