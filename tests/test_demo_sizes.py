"""`make demo` sizes itself to the machine (scripts/demo.py): the config's sizes on a fast CPU with
native bf16, MEDIUM on a slower one with native bf16, COMPACT_FAST / COMPACT without it by the fp32 rate
(valid config keys, smaller work, said aloud); the user's key=value arguments still win."""

import importlib.util

import pytest

from core.config import load_config
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts/demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


@pytest.mark.parametrize("gflops, precision, expected", [(290.0, "bf16", "FULL"), (125.0, "no", "COMPACT"),
                                                          (133.0, "no", "COMPACT_FAST"), (290.0, "no", "COMPACT_FAST"),
                                                          (103.0, "bf16", "MEDIUM")])
def test_sizes_follow_the_machine(monkeypatch, capsys, gflops, precision, expected):
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "fp32_matmul_gflops", lambda: gflops)
    monkeypatch.setattr(demo, "resolve_precision", lambda name: precision)
    sizes = demo.machine_sizes()
    assert sizes == getattr(demo, expected, [])
    compact = expected != "FULL"
    assert (f"{gflops:.0f} GFLOP/s" in capsys.readouterr().out) == compact
    full = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [])
    small = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", [*sizes, "train.epochs=7"])
    work = small.data_gen.num_samples * small.eval.max_new_tokens * small.eval.max_prompts
    assert (work < full.data_gen.num_samples * full.eval.max_new_tokens * full.eval.max_prompts) == compact
    assert small.data_gen.num_samples == {"FULL": 1216, "MEDIUM": 1024, "COMPACT_FAST": 768, "COMPACT": 448}[expected]
    assert small.train.epochs == 7  # the user's override wins
    assert small.train.ttt_steps == (2 if precision == "no" else 3)  # fp32 tiers: K=2 buys ~1/4 of training


def test_the_matmul_rate_is_measured_over_the_whole_time(monkeypatch):
    calls = []
    product = demo.torch.Tensor.__matmul__
    monkeypatch.setattr(demo.torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or product(a, b))
    start = demo.time.perf_counter()
    assert 1.0 < demo.fp32_matmul_gflops(seconds=0.2) < 1e5
    assert demo.time.perf_counter() - start >= 0.2 and len(calls) >= 3  # repeated for the time, not 3 tries


@pytest.mark.parametrize("overrides, every", [(["data_gen.num_samples=448", "train.epochs=4", "train.batch_size=4"], 150),
                                              (["data_gen.num_samples=448", "train.epochs=4", "train.batch_size=16"], 38),
                                              (["data_gen.num_samples=5", "train.epochs=1", "train.batch_size=16"], 1)])
def test_tau_probes_are_a_few_whatever_the_batch(overrides, every):
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml", overrides)
    assert demo.tau_every(cfg) == every
