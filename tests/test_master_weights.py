"""train.kernels.bf16_weights: bf16 weights with fp32 masters in the optimizer (train/master_weights.py).

The optimizer must step the masters exactly as torch's AdamW steps fp32 weights, carry the masters through
a checkpoint (a resumed run continues from them, not from the rounded weights), and a whole run must stop
and resume to the drafter an uninterrupted run exports. Tiny random target, CPU, bf16 autocast.
"""

import io
import json
import shutil

import pytest
import torch

from core.run.config import TrainKernels, load_config
from tests.conftest import ROOT, run_cli
from train.master_weights import MasterWeightAdamW, weights_to_bf16

BF16 = ["train.mixed_precision=bf16", "train.kernels.bf16_weights=true", "train.wandb_mode=disabled", "train.epochs=3",
        "train.lr=3e-3"]


@pytest.fixture(autouse=True)
def own_precision():
    """Accelerate fixes the precision once per process, and these runs train in bf16 where other files' runs in
    the same test worker train in fp32: its state is cleared around each test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def grads_for(params, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_masters_step_as_adamw_steps_fp32_weights_and_the_lr_set_by_the_loop_applies():
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(8, 4, generator=g), torch.randn(5, generator=g)]
    ref = [w.clone().requires_grad_() for w in start]
    bf16 = [w.to(torch.bfloat16).requires_grad_() for w in start]
    a = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    b = MasterWeightAdamW(bf16, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    b.masters = [m.copy_(w) for m, w in zip(b.masters, start, strict=True)]  # masters from the fp32 start
    for step in range(4):
        for group in (*a.param_groups, *b.param_groups):  # as train/fit.py sets the schedule's lr
            group["lr"] = 1e-2 / (step + 1)
        grads_for(bf16, step)
        for r, w in zip(ref, bf16, strict=True):
            r.grad = w.grad.float()  # the same (bf16-exact) gradients
        a.step()
        b.step()
    for r, m, w in zip(ref, b.masters, bf16, strict=True):
        assert torch.equal(m, r.detach())
        assert w.dtype == torch.bfloat16 and torch.equal(w.detach(), r.detach().to(torch.bfloat16))


def test_state_dict_carries_the_masters_so_a_resumed_optimizer_steps_identically():
    def fresh(weights):
        ws = [w.detach().clone().requires_grad_() for w in weights]
        return ws, MasterWeightAdamW(ws, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)

    weights, opt = fresh([torch.randn(16, 16).to(torch.bfloat16)])
    for step in range(3):
        grads_for(weights, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as Accelerate's save_state writes it, read back weights-only
    (resumed_w, resumed), (recloned_w, recloned) = fresh(weights), fresh(weights)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    buf.seek(0)  # what a checkpoint without the masters would continue from: the moments, masters = weights
    recloned.inner.load_state_dict(torch.load(buf, weights_only=True)["inner"])
    assert not torch.equal(opt.masters[0], recloned.masters[0])  # lr 1e-2 steps are below bf16's resolution
    for step in range(3, 5):
        for ws, o in ((weights, opt), (resumed_w, resumed), (recloned_w, recloned)):
            grads_for(ws, step)
            o.step()
    assert torch.equal(resumed.masters[0], opt.masters[0]) and torch.equal(resumed_w[0], weights[0])
    assert not torch.equal(recloned.masters[0], opt.masters[0])


def test_train_builds_the_master_weight_optimizer_for_bf16_weights():
    from core.run.config import TrainConfig
    from train.loop import make_optimizer

    w = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
    masters = make_optimizer(w, TrainConfig(kernels=TrainKernels(bf16_weights=True)))
    assert isinstance(masters, MasterWeightAdamW) and masters.inner.defaults["fused"]
    plain = make_optimizer([torch.zeros(3, requires_grad=True)], TrainConfig())
    assert type(plain) is torch.optim.AdamW and plain.defaults["fused"]  # one kernel, not the foreach loop


def test_fused_adamw_steps_as_the_foreach_one():
    """The fused optimizer train builds takes the steps the default (foreach) AdamW takes, to rounding."""
    from core.run.config import TrainConfig
    from train.loop import make_optimizer

    torch.manual_seed(0)
    start, grads = torch.randn(64, 32), [torch.randn(64, 32) for _ in range(5)]
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    fused = make_optimizer([a], TrainConfig(weight_decay=0.1))
    plain = torch.optim.AdamW([b], lr=fused.defaults["lr"], betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for g in grads:
        for w, opt in ((a, fused), (b, plain)):
            w.grad = g.clone()
            opt.step()
    assert not torch.equal(a, start)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_weights_to_bf16_leaves_buffers():
    from core.drafters.drafter import DrafterConfig, Eagle3Drafter

    d = Eagle3Drafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=16, vocab_size=100, draft_vocab_size=20, target_hidden_size=32))
    weights_to_bf16(d)
    assert {p.dtype for p in d.parameters()} == {torch.bfloat16}
    assert d.aux_scale.dtype == torch.float32 and d.t2d.dtype == torch.bool and d.d2t.dtype == torch.int64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One tiny run's conversations + hidden shards, copied into each test's run dirs."""
    from data_gen.generate import main as generate
    from extract.run import main as extract

    cfg = load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={tmp_path_factory.mktemp('mw') / 'run'}"])
    generate(cfg)
    extract(cfg)
    return cfg.run_path


def run_in(root, data, *extra):
    for part in ("conversations", "hidden"):
        if not (root / part).exists():
            shutil.copytree(data / part, root / part)
    return load_config(ROOT / "configs/tiny-random-llama.yaml", [f"run_dir={root}", *BF16, *extra])


def test_a_bf16_weight_run_stopped_and_resumed_exports_what_an_uninterrupted_run_exports(data, tmp_path):
    from safetensors.torch import load_file

    from train.loop import main as train

    whole = run_in(tmp_path / "whole", data)
    train(whole)
    split = run_in(tmp_path / "split", data, "train.stop_after=4")
    train(split)
    assert not (split.run_path / "drafter").exists()
    train(run_in(tmp_path / "split", data))
    rows = [json.loads(x) for x in (whole.run_path / "train/metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    a, b = (load_file(r.run_path / "drafter/model.safetensors") for r in (whole, split))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    settings = json.loads((whole.run_path / "train/manifest.json").read_text())["settings"]
    assert settings["train.kernels.bf16_weights"] is True  # a run of the other layout trains anew, never resumes this one


def test_bf16_weights_without_bf16_training_is_refused_before_anything_is_written(data, tmp_path):
    """A process of its own: Accelerate's precision is fixed once per process (the run above took bf16)."""
    run_in(tmp_path / "fp32", data)
    proc = run_cli("train", "--config", "configs/tiny-random-llama.yaml", "--run-dir", str(tmp_path / "fp32"), *BF16,
                   "train.mixed_precision=fp32", check=False)
    assert proc.returncode != 0
    assert ("train.kernels.bf16_weights = true needs bf16 training: train.mixed_precision resolved to 'fp32' here; set "
            "train.mixed_precision=bf16 or train.kernels.bf16_weights=false") in proc.stderr
    assert not (tmp_path / "fp32/train/manifest.json").exists() and not (tmp_path / "fp32/drafter").exists()
