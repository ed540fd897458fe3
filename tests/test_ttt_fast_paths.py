"""The fast TTT paths compute the plain reference's function (issue 13): flex attention with the TTT
block mask and the causal kernel + log-sum-exp merge (train.kernels.attention=cudnn; PyTorch's CPU flash kernel
here) against the dense [T,T] attention, the fused chunked head loss against plain autograd, and
activation checkpointing, at 1e-5 in fp32 on random inputs with partial loss masks.
Flex attention has no backward on CPU, so its gradients are checked on the GPU (bench/bench_train_step.py)."""

import dataclasses
import re

import pytest
import torch

from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import MLAShape
from core.run.config import load_config
from train import ttt_attention
from train.draft_head_loss import TeacherRows, draft_head_loss
from train.ttt_attention import (
    dense_ttt_attention,
    flex_ttt_attention,
    merged_ttt_attention,
    padded_length,
    ttt_block_mask,
)
from train.ttt_loss import Rows, StepOptions, Teacher, TTTObjective, ttt_loss

TOL = {"rtol": 1e-5, "atol": 1e-5}


def drafter(seed=0, vd=48) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=80, draft_vocab_size=vd, target_hidden_size=32)
    d = Eagle3Drafter(c)
    torch.nn.init.normal_(d.embed_tokens.weight)
    d.t2d[:vd] = True
    return d


def inputs(b, t, d: Eagle3Drafter, seed=1):
    """Random aux, tokens, a loss mask of random spans (about half on), and a random teacher whose
    argmax is out of the draft vocab at ~20% of positions."""
    g = torch.Generator().manual_seed(seed)
    vd = d.config.draft_vocab_size
    aux = torch.randn(b, t, 3 * d.config.target_hidden_size, generator=g)
    ids = torch.randint(0, d.config.vocab_size, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.5).to(torch.uint8)
    p = torch.softmax(3 * torch.randn(b, t, vd, generator=g), -1)
    teacher = Teacher(p, p.argmax(-1), torch.rand(b, t, generator=g) > 0.2, torch.ones(b, t))
    return aux, ids, mask, teacher


# flex's unfused eager kernel on purpose: the mask's math, checked where CI runs (CUDA compiles it)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("t", [128, 200])
def test_flex_block_mask_attention_equals_dense(t):
    """Every step count, GQA, a length that needs padding to whole blocks; fresh random inputs each."""
    g = torch.Generator().manual_seed(t)
    tp = padded_length(t)
    for steps in range(1, 5):
        q = torch.randn(2, 4, tp, 16, generator=g)
        keys = [torch.randn(2, 2, tp, 16, generator=g) for _ in range(steps)]
        values = [torch.randn(2, 2, tp, 16, generator=g) for _ in range(steps)]
        dense = dense_ttt_attention(q[:, :, :t], [k[:, :, :t] for k in keys], [v[:, :, :t] for v in values])
        flex = flex_ttt_attention(q, keys, values, ttt_block_mask(tp, steps, q.device), compiled=False)
        torch.testing.assert_close(flex[:, :, :t], dense, **TOL)


def test_causal_kernel_merged_with_the_diagonal_equals_dense_with_gradients():
    """Outputs and the gradients of q and every step's keys and values (GQA, steps 1-4, a length off any
    block size): the kernel's backward, handed the merged output and log-sum-exp, plus the diagonal terms."""
    g = torch.Generator().manual_seed(7)
    for steps in range(1, 5):
        q = torch.randn(2, 4, 37, 16, generator=g, requires_grad=True)
        keys = [torch.randn(2, 2, 37, 16, generator=g, requires_grad=True) for _ in range(steps)]
        values = [torch.randn(2, 2, 37, 16, generator=g, requires_grad=True) for _ in range(steps)]
        weight = torch.randn(2, 4, 37, 16, generator=g)  # a loss that weighs every output element differently
        results = []
        for attend in (dense_ttt_attention, merged_ttt_attention):
            out = attend(q, keys, values)
            results.append((out, *torch.autograd.grad((out * weight).sum(), [q, *keys, *values])))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(b, a, **TOL)


def test_merged_attention_takes_the_steps_transposed_views_as_contiguous_copies(monkeypatch):
    """The step hands q/k/v as transposed [B,T,n,d] views. On an H200 such inputs gave outputs and gradients
    10-100% off from step 2 on, contiguous copies 0.4% (bf16): the kernel must only ever see contiguous ones,
    and the gradients must still reach the views' leaves."""
    real, seen = ttt_attention._MergedAttention.apply, []
    monkeypatch.setattr(ttt_attention._MergedAttention, "apply",
                        lambda *xs: seen.append(all(x.is_contiguous() for x in xs)) or real(*xs))
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(2, 37, n, 16, generator=g, requires_grad=True) for n in (4, 2, 2, 2, 2)]
    q, k0, k1, v0, v1 = (x.transpose(1, 2) for x in leaves)
    results = []
    for attend in (dense_ttt_attention, merged_ttt_attention):
        out = attend(q, [k0, k1], [v0, v1])
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    assert seen == [True]
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, **TOL)


def test_block_mask_visits_causal_blocks_and_one_diagonal_block_per_later_step():
    bm = ttt_block_mask(3 * 128, 3, torch.device("cpu"))
    dense = bm.to_dense()[0, 0]  # [query blocks, key blocks]: 1 where the kernel reads the block
    expected = torch.zeros(3, 9, dtype=dense.dtype)
    for i in range(3):
        expected[i, : i + 1] = 1  # step 0: causal
        expected[i, 3 + i] = expected[i, 6 + i] = 1  # steps 1, 2: the diagonal block only
    assert torch.equal(dense, expected)
    with pytest.raises(ValueError, match="multiple of 128"):
        ttt_block_mask(100, 1, torch.device("cpu"))


def test_fused_head_loss_equals_plain_autograd():
    """Values, per-step sums, accuracy counts and both gradients, over several chunks of rows."""
    g = torch.Generator().manual_seed(3)
    h, vd = 16, 40
    weight = torch.randn(vd, h, generator=g, requires_grad=True)
    p = torch.softmax(2 * torch.randn(50, vd, generator=g), -1)
    top = p.argmax(-1)
    xs = [torch.randn(n, h, generator=g, requires_grad=True) for n in (17, 0, 9)]  # a step with no rows
    rows = [torch.randint(0, 50, (x.shape[0],), generator=g) for x in xs]
    scales = torch.tensor([1.0, 0.8, 0.64]) / torch.tensor([17.0, 1.0, 9.0])
    out = {}
    for chunk in (0, 5):
        total, sums, correct, _ = draft_head_loss(xs, weight, TeacherRows(p, top), rows, scales, chunk)
        grads = torch.autograd.grad(2.5 * total, [weight, xs[0], xs[2]])
        out[chunk] = (total.detach(), sums, correct, *grads)
    assert out[0][2].tolist() == out[5][2].tolist()
    for a, b in zip(out[0], out[5], strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL)
    assert out[0][1][0] > 0 and out[0][1][1] == 0


def assert_trains_like_the_reference(d: Eagle3Drafter, steps: int, options: dict) -> None:
    """TTTObjective with `options` vs the plain one (dense attention, plain head loss, no checkpointing, no
    compile) on one random batch: loss, per-step sums and every gradient at TOL."""
    aux, ids, mask, teacher = inputs(2, 40, d)
    results = []
    for o in ({}, options):
        d.zero_grad(set_to_none=True)
        loss, sums = TTTObjective(d, steps, 0.8, StepOptions(**o))(aux, ids, mask, teacher)
        loss.backward()
        results.append((loss.detach(), sums, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (l0, s0, g0), (l1, s1, g1) = results
    torch.testing.assert_close(l1, l0, **TOL)
    for key in s0:
        torch.testing.assert_close(s1[key], s0[key], **TOL)
    assert sorted(g0) == sorted(g1) and len(g0) >= 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **TOL, msg=name)


@pytest.mark.parametrize("options", [{"loss_chunk": 7}, {"loss_chunk": 7, "checkpoint": True},
                                     {"loss_chunk": 0, "checkpoint": True}, {"attention": "merged", "loss_chunk": 7},
                                     {"attention": "merged", "checkpoint": True}, {"prune_rows": True},
                                     {"prune_rows": True, "loss_chunk": 7, "checkpoint": True},
                                     {"prune_rows": True, "attention": "merged"}])
def test_ttt_loss_options_give_the_reference_loss_and_gradients(options):
    assert_trains_like_the_reference(drafter(), 4, options)


def test_pruned_steps_run_on_the_counted_rows_only(monkeypatch):
    """prune_rows: step k runs its layer's o_proj and MLP (steps >= 1: the whole layer) on the rows that it or a
    later step counts, a shrinking subset of B*T (what makes the CPU step cheaper), each row counted by some
    step >= k; step 0 still projects every row's keys and values (the prompt is attended to)."""
    from train import ttt_loss as module

    d, seen = drafter(), []
    real_rows, real_finish = module.ttt_step_rows, d.finish

    def spy_rows(drafter, hidden, *args):
        seen.append(("rows", hidden.shape[0], args[-1]))
        return real_rows(drafter, hidden, *args)

    def spy_finish(attn, residual):
        seen.append(("finish", residual.shape[1], None))
        return real_finish(attn, residual)

    monkeypatch.setattr(module, "ttt_step_rows", spy_rows)
    monkeypatch.setattr(d, "finish", spy_finish)
    first, real_attention = [], module.ttt_attention
    monkeypatch.setattr(module, "ttt_attention", lambda q, *a: first.append(q.shape) or real_attention(q, *a))
    aux, ids, mask, teacher = inputs(2, 40, d)
    mask[:, :20] = 0  # a prompt: no step counts a row there
    TTTObjective(d, 4, 0.8, StepOptions(prune_rows=True))(aux, ids, mask, teacher)
    masks = [module.counted(mask, teacher[2], None, k) for k in range(4)]
    assert first[0][0] == 2 and first[0][2] == 40  # step 0's attention: every row's query, key and value
    finishes = [n for kind, n, _ in seen if kind == "finish"]
    steps = [(n, where) for kind, n, where in seen if kind == "rows"]
    assert len(finishes) == 4 and len(steps) == 3
    assert finishes == sorted(finishes, reverse=True) and finishes[1:] == [n for n, _ in steps]
    # a step counts rows 15..37 at most: the last step reads x[t+5] (the answer starts at 20), the first x[t+2]
    assert 0 < finishes[0] <= 2 * 23 and finishes[0] == int(torch.stack(masks).any(0).sum())
    for k, (n, (bi, ti)) in enumerate(steps, start=1):
        assert 0 < n <= 2 * 23
        assert torch.stack(masks[k:]).any(0)[bi, ti].all() and int(torch.stack(masks[k:]).any(0).sum()) == n


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_pruned_steps_take_a_batch_that_no_later_step_counts(mla):
    """A micro-batch of prompts only (or answers too short for steps >= 1): the pruned steps run on 0 rows and
    give the plain path's zero loss and gradients, not an error (an MLA layer's heads too)."""
    d = drafter()
    if mla:
        gqa, d = d, Eagle3Drafter(dataclasses.replace(d.config, mla=MLAShape(24, 16, 8, 4, 6)))
        d.load_state_dict({k: v for k, v in gqa.state_dict().items() if "self_attn" not in k}, strict=False)
    aux, ids, mask, teacher = inputs(2, 40, d)
    mask[:] = 0
    mask[:, 2] = 1  # one answer token, x[2]: step 0 counts row 0 (x[t+2]); step k >= 1 would need row -k
    teacher[2][:, 1] = True  # the target's argmax at 1 is in the draft vocab
    results = []
    for prune in (False, True):
        d.zero_grad(set_to_none=True)
        loss, sums = TTTObjective(d, 4, 0.8, StepOptions(prune_rows=prune))(aux, ids, mask, teacher)
        loss.backward()
        results.append((loss.detach(), sums["count"], d.fc.weight.grad))
    (l0, c0, g0), (l1, c1, g1) = results
    assert c1.tolist() == c0.tolist() == [2, 0, 0, 0]
    torch.testing.assert_close(l1, l0, **TOL)
    torch.testing.assert_close(g1, g0, **TOL)


def test_ttt_loss_with_flex_attention_equals_dense(monkeypatch):
    """The whole unroll with flex (eager reference kernel, forward: no CPU backward) on a length that is
    padded to 128: same loss and sums as the dense path."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(ttt_attention, "_compiled_flex", lambda: flex_attention)
    d = drafter()
    aux, ids, mask, teacher = inputs(2, 100, d)
    with torch.no_grad():
        dense = ttt_loss(d, Rows(aux, ids, mask), teacher, 4, 0.8)
        flex = ttt_loss(d, Rows(aux, ids, mask), teacher, 4, 0.8, StepOptions("flex", loss_chunk=64))
    torch.testing.assert_close(flex[0], dense[0], **TOL)
    for key in dense[1]:
        torch.testing.assert_close(flex[1][key], dense[1][key], **TOL)
    assert dense[1]["count"].min() > 10


def test_step_options_name_the_setting_that_cannot_run():
    """train.kernels -> the step's options: auto picks the fastest path measured for the device, the drafter and
    the rows; settings that cannot run stop before any training with the setting's name."""
    from core.run.config import TrainKernels
    from core.run.errors import UserError
    from train.loop import step_options

    def dc(hidden=4096, head_dim=128):
        return DrafterConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=hidden // head_dim,
                             num_key_value_heads=1, head_dim=head_dim, vocab_size=80, draft_vocab_size=48,
                             target_hidden_size=hidden)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # the plain path on CPU and, on CUDA, for a narrow drafter (launch-bound: compiling buys nothing back there)
    assert step_options(TrainKernels(), cpu, dc()) == StepOptions("dense", 8192, False, False, prune_rows=True)
    assert step_options(TrainKernels(), cuda, dc(576, 64)) == StepOptions("dense", 8192, False, False, True)
    # a wide drafter on CUDA: cuDNN's attention in the K-step unroll, flex for packed rows
    assert step_options(TrainKernels(), cuda, dc()) == StepOptions("merged", 8192, False, True, False)
    assert step_options(TrainKernels(pack_length=4096), cuda, dc()).attention == "flex"
    # cuDNN takes head dims that are multiples of 8 up to 128; flex's kernels >= 16; below, dense
    assert step_options(TrainKernels(), cuda, dc(7168, 112)).attention == "merged"
    assert step_options(TrainKernels(), cuda, dc(6144, 192)).attention == "flex"
    assert step_options(TrainKernels(), cuda, dc(3072, 12)).attention == "dense"
    assert step_options(TrainKernels(attention="cudnn"), cpu, dc()).attention == "merged"  # the CPU flash kernel
    with pytest.raises(UserError, match="flex: its CUDA kernels need a head dim of at least 16, this drafter's is 8"):
        step_options(TrainKernels(attention="flex"), cuda, dc(4096, 8))
    with pytest.raises(UserError, match="cudnn: cuDNN takes head dims that are multiples of 8 up to 128, this "
                                        "drafter's is 192"):
        step_options(TrainKernels(attention="cudnn"), cuda, dc(6144, 192))
    with pytest.raises(UserError, match="train.kernels.attention = cudnn takes one document per row"):
        step_options(TrainKernels(attention="cudnn", pack_length=4096), cuda, dc())
    with pytest.raises(UserError, match="train.kernels.attention = flex needs a CUDA device"):
        step_options(TrainKernels(attention="flex"), cpu, dc())
    unrolled = step_options(TrainKernels(compile="unroll"), cpu, dc(576, 64))
    assert unrolled.unroll and not unrolled.prune_rows and unrolled.compile_backend == "inductor"
    aot = step_options(TrainKernels(compile="unroll", compile_backend="aot_eager"), cpu, dc())
    assert aot.compile_backend == "aot_eager"
    with pytest.raises(UserError, match=re.escape("train.kernels.attention = 'flesh': must be one of 'auto' |")):
        load_config(overrides=["train.kernels.attention=flesh"])


@pytest.mark.parametrize("attention", ["dense", "merged"])
def test_unrolled_compile_gives_the_reference_loss_and_gradients(monkeypatch, attention):
    """train.kernels.compile=unroll: all K steps traced as one graph (AOTAutograd's joint forward/backward, here with
    the aot_eager backend: inductor's kernels are the GPU's business) train what the plain loop trains."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from train import ttt_loss as module

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(module, "compiled", lambda fn, backend: torch.compile(fn, backend=counter))
    assert_trains_like_the_reference(drafter(), 3, {"unroll": True, "loss_chunk": 7, "attention": attention})
    assert counter.frame_count == 1  # the three steps became one graph (the merged kernel inside it), and it ran


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_merged_attention_checks_itself_against_the_dense_path_and_names_what_is_off(monkeypatch, mla):
    """train/attention_check.py: on a correct kernel (CPU, fp32) every gradient agrees and the check passes; with
    the diagonal terms dropped, as a broken kernel might, it stops with the parameter and the limit. The caller's
    RNG is left as it was (training's data order and init must not depend on whether the kernel was checked)."""
    from core.run.errors import UserError
    from train import attention_check
    from train import ttt_loss as module

    state = torch.get_rng_state()
    errors = attention_check.merged_gradient_errors(torch.device("cpu"), mla)  # MLA: v heads narrower than q/k
    assert torch.equal(torch.get_rng_state(), state)
    assert len(errors) >= 10 and max(errors.values()) < 1e-4
    assert ("midlayer.self_attn.kv_b_proj.weight" in errors) == mla
    attention_check.check_merged_attention(torch.device("cpu"), mla)
    real = module.merged_ttt_attention
    monkeypatch.setattr(module, "merged_ttt_attention", lambda q, keys, values: real(q, keys[:1], values[:1]))
    with pytest.raises(UserError, match=r"train.kernels.attention = cudnn: on this CPU its gradients differ from the "
                                        r"dense path's by up to \d+\.\d% \(.+; 3% allowed\): use "
                                        r"train.kernels.attention=flex"):
        attention_check.check_merged_attention(torch.device("cpu"), mla)


@pytest.mark.parametrize("draft_attention", ["gqa", "mla"])
def test_step_benchmark_runs_and_records_a_finite_step(tmp_path, draft_attention):
    """bench/bench_train_step.py --smoke (tiny shapes, CPU): the GPU benchmark's own step code runs and writes
    its record, so the script the docs' GPU tables come from cannot rot between device sessions."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "step.jsonl"
    script = Path(__file__).resolve().parents[1] / "bench" / "bench_train_step.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--draft-attention", draft_attention, "--out", str(out)],
                   check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["impl"] == "eagle3" and rec["seq_len"] == 64 and "error" not in rec
    assert rec["grads_finite"] and rec["weights_finite"] and rec["tokens_per_s"] > 0
    assert rec["loss"] > 0 and rec["loss"] < float("inf")


def test_teacher_probabilities_are_kept_in_the_matmul_dtype():
    """teacher_targets stores p in draft_head's dtype: bf16 under bf16 training (half the tensor the head loss
    reads once per step), the fp32 softmax rounded once; fp32 stays fp32. Rows that are never a target stay 0."""
    from train.ttt_loss import teacher_targets

    g = torch.Generator().manual_seed(4)
    final, head = torch.randn(2, 12, 16, generator=g), torch.randn(24, 16, generator=g)
    mask = (torch.rand(2, 12, generator=g) < 0.6).to(torch.uint8)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[:24] = True
    argmax = torch.randint(0, 40, (2, 12), generator=g)
    need = torch.zeros(2, 12, dtype=torch.bool)
    need[:, :-1] = mask[:, 1:].bool()
    for dtype in (torch.float32, torch.bfloat16):
        p, top, in_vocab, _ = teacher_targets(final, mask, head.to(dtype), t2d, argmax)
        assert p.dtype == dtype
        want = torch.softmax((final.to(dtype) @ head.to(dtype).T).float(), -1).to(dtype)
        torch.testing.assert_close(p[need], want[need], rtol=0, atol=0)
        assert not p[~need].any() and torch.equal(in_vocab[need], t2d[argmax[need]])
