#!/usr/bin/env python3
"""The EAGLE-3 training step at the 8B drafter's shape, beside SpecForge's, in one command (GPU).

    python bench/bench_train_step.py --with-optimizer --seqlens 2048,4096,8192,16384 \
        --specforge-wheel specforge-0.2.0-py3-none-any.whl --specforge-harness specforge_step.py
    python bench/bench_train_step.py --smoke          # CPU check of this script (tiny shapes)
    python bench/bench_train_step.py --config configs/kimi-k2.5.yaml --target-config configs/targets/kimi-k2.5 \
        --draft-attention mla --variants config,dense   # Kimi-K2.5's MLA drafter (gqa: its Llama-style one)

The step runs with the train.kernels of --config (default configs/llama-3.1-8b-instruct.yaml, the shipped 8B
recipe), resolved by train.loop.step_options on this device as a run resolves them: variant `config` is what a
user of that config gets; the other variants change one kernel choice. One step = what train/loop.py does per
micro-batch: teacher_targets (draft-vocab softmax from the target's final hidden states) + the TTTObjective
forward (K=7 TTT unroll) + accelerator.backward, under Accelerate bf16 autocast, the frozen embedding in bf16;
--with-optimizer adds train/fit.py's gradient clip at 0.5 and AdamW step (SpecForge's side then runs
bench/specforge_full_step.py: its BF16Optimizer with fp32 masters), and peak memory counts the optimizer
state each side holds. Shape: H=4096, I=14336, 32/8 heads, head_dim 128, vocab 128256, draft vocab 32000,
batch 1, every position in the loss mask.

FLOPs per token (model FLOPs, the count SpecForge's harness uses, so MFU compares 1:1):
fc 2*3H*H, x2 (forward + weight grad); per TTT step, x3 (forward + input grad + weight grad): qkv
2*2H*(nh+2*nkv)*d, o_proj 2*nh*d*H, mlp 2*3*H*I, lm_head 2*H*Vd, attention 4*nh*d*((T+1)/2 + k).
Not counted: norms, RoPE, SiLU, softmaxes, the teacher's draft-vocab matmul (2*H*Vd per token; SpecForge
is handed target logits instead). MFU against --peak-tflops (784: bf16 matmul measured on an H200).

--parity first checks on the GPU, in fp32, that flex attention (eager and unrolled, padded and packed rows)
gives the dense reference path's loss, per-step sums and every gradient (CPU tests cannot: flex has no CPU
backward); then, under bf16 autocast (cuDNN's attention has no fp32 kernel), flex and cudnn unrolled against
dense; then the merged attention alone in bf16 against fp32 dense. SpecForge's harness (if given) runs one
subprocess per length, just before ours at that length, so a run cut short leaves whole pairs. Each length
starts from a fresh torch.compile cache, so its graphs are static-shape, as a run of packed rows of one
length is.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.drafters.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from core.drafters.drafter_config import DraftVariant, MLAShape  # noqa: E402
from core.run.config import TrainConfig, TrainKernels, load_config  # noqa: E402
from core.run.plan import drafter_params  # noqa: E402
from core.target.model import read_target_config  # noqa: E402
from train.loop import cudnn_takes, frozen_to_matmul_dtype, make_optimizer, step_options  # noqa: E402
from train.loss_kind import HeadLoss  # noqa: E402
from train.master_weights import weights_to_bf16  # noqa: E402
from train.packing import pack  # noqa: E402
from train.ttt_loss import TTTObjective, teacher_targets  # noqa: E402

SHAPE = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, draft_vocab=32000)
SMOKE = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512, draft_vocab=128)


def drafter_config(s: dict) -> DrafterConfig:
    """The drafter of shape s (mla: an MLAShape for an MLA draft layer, else GQA)."""
    return DrafterConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                         draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], rope_theta=500000.0,
                         max_position_embeddings=131072, mla=s.get("mla"))


def target_shape(path: str, draft_attention: str, draft_vocab: int = 32000) -> dict:
    """--target-config: the drafter train builds for that target (a config.json's dir, e.g.
    configs/targets/kimi-k2.5), GQA or MLA of the target's sizes."""
    tc = read_target_config(Path(path))
    mla = MLAShape.for_target(tc, {}) if draft_attention == "mla" else None
    dc = DrafterConfig.for_target(tc, [], draft_vocab, DraftVariant(mla=mla))
    return dict(hidden=dc.hidden_size, intermediate=dc.intermediate_size, heads=dc.num_attention_heads,
                kv_heads=dc.num_key_value_heads, head_dim=dc.head_dim, vocab=dc.vocab_size, draft_vocab=draft_vocab,
                mla=mla)


def flops_per_token(s: dict, t: int, k_steps: int, span: float | None = None) -> float:
    """span: the mean number of step-0 keys a query attends to ((t+1)/2 for one causal document). Linear layers:
    2 FLOPs per weight (core.run.plan.drafter_params); attention 2 * heads * (q/k width + v width) per key."""
    dc = drafter_config(s)
    p = drafter_params(dc)
    span = (t + 1) / 2 if span is None else span
    fc, linear = 2 * p["fc"], 2 * (p["self_attn"] + p["mlp"] + p["lm_head"])
    v_width = dc.mla.v_head_dim if dc.mla else dc.head_dim
    attn = sum(2 * dc.num_attention_heads * (dc.qk_head_dim + v_width) * (span + k) for k in range(k_steps))
    return 2 * fc + 3 * (k_steps * linear + attn)


def build(s: dict, device: torch.device, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    with torch.device(device):
        d = Eagle3Drafter(drafter_config(s))
    draft_ids = torch.randperm(s["vocab"], generator=torch.Generator().manual_seed(0))[: s["draft_vocab"]].sort().values
    d.t2d.zero_()
    d.t2d[draft_ids.to(device)] = True
    return d


def batch(s: dict, b: int, t: int, d: Eagle3Drafter, device, mask_frac: float = 1.0, seed: int = 1):
    """Inputs as train/data.collate hands them (aux and final fp32) plus the precomputed argmax; the full-vocab
    logsumexp is `with_teacher_lse`'s, from the draft head."""
    g = torch.Generator(device=device).manual_seed(seed)
    draft_ids = d.t2d.nonzero().flatten()
    loss_mask = (torch.rand(b, t, device=device, generator=g) < mask_frac).to(torch.uint8)
    argmax = draft_ids[torch.randint(0, draft_ids.numel(), (b, t), device=device, generator=g)]
    if mask_frac < 1:  # some argmaxes outside the draft vocab too
        argmax = torch.where(torch.rand(b, t, device=device, generator=g) < 0.2, (~d.t2d).nonzero()[0, 0], argmax)
    return {"aux": torch.randn(b, t, 3 * s["hidden"], device=device, generator=g),
            "final": torch.randn(b, t, s["hidden"], device=device, generator=g),
            "input_ids": torch.randint(0, s["vocab"], (b, t), device=device, generator=g),
            "loss_mask": loss_mask, "argmax": argmax}


def with_teacher_lse(x: dict, draft_head: torch.Tensor) -> dict:
    """x + teacher_lse: the full-vocab logsumexp as if the draft vocab held 85% of the target's probability (the
    draft-vocab mass `teacher_targets` computes each step)."""
    with torch.no_grad():
        lse = torch.logsumexp((x["final"].to(draft_head.dtype) @ draft_head.T).float(), -1) - math.log(0.85)
    return {**x, "teacher_lse": lse}


def documents(t: int, b: int, device) -> tuple[dict, float]:
    """Each row as packed documents of 1/16..1/4 of t tokens (train.pack_length): -> ({doc_ids, positions}
    [b,t]), the mean causal span a query attends to)."""
    g = torch.Generator().manual_seed(t)
    lengths = []
    while sum(lengths) < t:
        lengths.append(min(int(torch.randint(t // 16, t // 4 + 1, (1,), generator=g)), t - sum(lengths)))
    n = torch.tensor(lengths)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), n)
    positions = torch.cat([torch.arange(k) for k in lengths])
    span = float((n * (n + 1) / 2).sum()) / t
    return {"doc_ids": doc_ids.expand(b, t).to(device), "positions": positions.expand(b, t).to(device)}, span


def objective_for(d: Eagle3Drafter, device, k_steps: int, kernels: TrainKernels, loss: str = "kl") -> TTTObjective:
    return TTTObjective(d, k_steps, 0.8, step_options(kernels, device, d.config), HeadLoss(loss))


def bench(args, s: dict, t: int, variant: str, kernels: TrainKernels, device, loss: str = "kl") -> dict:
    from accelerate import Accelerator

    rec = {"impl": "eagle3", "variant": variant, "kernels": dataclasses.asdict(kernels), "seq_len": t,
           "batch": args.batch, "ttt": args.ttt, "head_loss": loss}
    torch._dynamo.reset()  # static-shape graphs for this length
    d = build(s, device)
    frozen_to_matmul_dtype(d, "bf16" if device.type == "cuda" else "fp32")
    if kernels.bf16_weights:  # as train/loop.py does under train.kernels.bf16_weights
        weights_to_bf16(d)
    accelerator = Accelerator(mixed_precision="bf16" if device.type == "cuda" else "no", cpu=device.type != "cuda")
    objective = accelerator.prepare(objective_for(d, device, args.ttt, kernels, loss))
    rec["attention"], rec["unroll"] = objective.options.attention, objective.options.unroll
    draft_head = (torch.randn(s["draft_vocab"], s["hidden"], device=device) * s["hidden"] ** -0.5).to(
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    x = with_teacher_lse(batch(s, args.batch, t, d, device), draft_head)
    docs, span = documents(t, args.batch, device) if kernels.pack_length else ({}, None)
    params = [p for p in objective.parameters() if p.requires_grad]
    tc = TrainConfig(lr=1e-5, kernels=kernels)
    opt = accelerator.prepare(make_optimizer(params, tc)) if args.with_optimizer else None
    rec["optimizer"] = type(opt.optimizer).__name__ if opt else None

    def step():
        for p in params:
            p.grad = None
        teacher = teacher_targets(x["final"], x["loss_mask"], draft_head, d.t2d, x["argmax"], docs.get("doc_ids"),
                                  x["teacher_lse"])
        loss, sums = objective(x["aux"], x["input_ids"], x["loss_mask"], teacher, **docs)
        accelerator.backward(loss)
        if opt:  # as train/fit.py: clip, step, grads to None
            accelerator.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rec["loss"] = float(loss.detach())
        return time.perf_counter() - t0

    rec["warmup_s"] = [round(timed(), 2) for _ in range(args.warmup)]
    if t in args.profile and device.type == "cuda":  # where the step's GPU time goes, by kernel
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            timed()
        print(f"profile of one {variant} step at T={t}:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
        if args.trace_dir:  # chrome://tracing or ui.perfetto.dev: the launch gaps between kernels
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace_{variant}_{t}.json"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timed() for _ in range(args.iters)]
    med = statistics.median(times)
    fl = flops_per_token(s, t, args.ttt, span) * args.batch * t
    rec.update(step_ms=round(med * 1e3, 1), step_ms_min=round(min(times) * 1e3, 1),
               step_ms_max=round(max(times) * 1e3, 1), tokens_per_s=round(args.batch * t / med),
               mfu=round(fl / med / (args.peak_tflops * 1e12), 4),
               grads_finite=None if opt else all(bool(torch.isfinite(p.grad).all()) for p in params),
               weights_finite=all(bool(torch.isfinite(p).all()) for p in params))
    if device.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return rec


def parity(args, device) -> dict:
    """fp32, small shape (an MLA layer of Kimi's head widths with --draft-attention mla), partial masks, a length
    that needs padding: fast path vs plain reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    s = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=2048, draft_vocab=512)
    if args.draft_attention == "mla":  # Kimi-K2.5's per-head MLA widths: q/k 128 + 64, v 128
        s["mla"] = MLAShape(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    d = build(s, device, seed=3)
    for p in d.parameters():  # O(1) random weights, so every path carries signal
        if p.dim() == 2 and p.requires_grad:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
    x = batch(s, 2, 300, d, device, mask_frac=0.6, seed=5)
    head = torch.randn(s["draft_vocab"], s["hidden"], device=device)
    # the same two samples as one packed row of two documents (train.kernels.pack_length): must train the same
    p = pack({**x, "valid": torch.ones_like(x["loss_mask"])}, 640)
    padded = (x, teacher_targets(x["final"], x["loss_mask"], head, d.t2d, x["argmax"]), {})
    packed = (p, teacher_targets(p["final"], p["loss_mask"], head, d.t2d, p["argmax"], p["doc_ids"]),
              {"doc_ids": p["doc_ids"], "positions": p["positions"]})
    flex = TrainKernels(attention="flex", loss_chunk=128, compile="no")
    unroll = dataclasses.replace(flex, compile="unroll")
    reference = TrainKernels(attention="dense", loss_chunk=0, compile="no")
    recs = []
    if "fp32" in args.parity:
        recs.append(compare(d, device, {"reference": (reference, padded), "flex": (flex, padded),
                                        "flex_ckpt": (dataclasses.replace(flex, activation_checkpointing=True), padded),
                                        "flex_packed": (flex, packed), "flex_unroll": (unroll, padded),
                                        "flex_unroll_packed": (unroll, packed)}, "parity"))
    torch.backends.cuda.matmul.allow_tf32 = True
    if "bf16" in args.parity:
        paths = {"reference": (reference, padded), "flex_unroll": (unroll, padded)}
        if cudnn_takes(d.config.kernel_head_dim):
            paths["cudnn_unroll"] = (dataclasses.replace(unroll, attention="cudnn"), padded)
        with torch.autocast("cuda", torch.bfloat16):  # cuDNN's attention has no fp32 kernel: all in bf16
            recs.append(compare(d, device, paths, "parity_bf16"))
    if "alone" in args.parity:
        recs.append(merged_attention_alone(device))
    return recs


def merged_attention_alone(device) -> dict:
    """The merged (cuDNN) TTT attention by itself in bf16 (the 8B shape's 32/8 heads at T=1024, and the parity's shape: batch
    2, 4/2 heads, T=300, d=64; steps 1-4) against the dense path in fp32 on the same bf16 inputs: relative error of
    the output and of each input's gradient, the worst per case. Inputs are transposed [B,T,n,d] views, as the
    step hands them (contiguous ones hid a 10-100% error that strided ones showed)."""
    from train.ttt_attention import dense_ttt_attention, merged_ttt_attention

    g = torch.Generator(device=device).manual_seed(11)
    worst = {}
    for (b, nh, nkv, t, d), steps in itertools.product(((1, 32, 8, 1024, 128), (2, 4, 2, 300, 64)), range(1, 5)):
        q, *kv = (torch.randn(b, t, n, d, device=device, generator=g).bfloat16().requires_grad_()
                  for n in (nh, *[nkv] * (2 * steps)))
        keys, values = kv[:steps], kv[steps:]
        qt, kt, vt = q.transpose(1, 2), [k.transpose(1, 2) for k in keys], [v.transpose(1, 2) for v in values]
        weight = torch.randn(b, nh, t, d, device=device, generator=g)
        results = []
        for out in (dense_ttt_attention(qt.float(), [k.float() for k in kt], [v.float() for v in vt]),
                    merged_ttt_attention(qt, kt, vt)):
            results.append((out.detach(), *torch.autograd.grad((out.float() * weight).sum(), [q, *keys, *values])))
        worst[f"B{b} {nh}/{nkv} heads T{t} d{d} steps {steps}"] = max(float((b.float() - a.float()).norm() / a.float().norm()) for a, b in zip(*results, strict=True))
    return {"kind": "merged_attention_alone_bf16", "rel_max": worst}


def attention_alone(args, s: dict, device) -> list[dict]:
    """The K attention calls of one unroll by themselves (forward + backward, bf16, the 8B shape's heads, q/k/v
    as the step's transposed views) per kernel: flex with the TTT block mask, cuDNN's causal kernel merged with the
    diagonal; and the merged one's accuracy against fp32 dense (merged_attention_alone)."""
    from train.ttt_attention import flex_ttt_attention, merged_ttt_attention, ttt_block_mask

    recs = []
    try:
        recs.append(merged_attention_alone(device))
    except Exception as e:  # noqa: BLE001 -- a kernel this GPU or torch lacks must not cost the others' figures
        recs.append({"kind": "merged_attention_alone_bf16", "error": f"{type(e).__name__}: {e}"[:400]})
    nh, nkv, d = s["heads"], s["kv_heads"], s["head_dim"]
    for t, kernel in itertools.product(args.seqlens, ("flex", "cudnn")):
        torch._dynamo.reset()
        masks = [ttt_block_mask(t, k, device) for k in range(1, args.ttt + 1)] if kernel == "flex" else None
        q = torch.randn(1, t, nh, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        kv = [torch.randn(1, t, nkv, d, device=device, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(2 * args.ttt)]

        def unroll(q=q, kv=kv, masks=masks, kernel=kernel):
            for k in range(1, args.ttt + 1):
                keys = [x.transpose(1, 2) for x in kv[:k]]
                values = [x.transpose(1, 2) for x in kv[args.ttt:args.ttt + k]]
                out = (flex_ttt_attention(q.transpose(1, 2), keys, values, masks[k - 1]) if kernel == "flex"
                       else merged_ttt_attention(q.transpose(1, 2), keys, values))
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()

        rec = {"kind": "attention_alone", "kernel": kernel, "seq_len": t, "ttt": args.ttt}
        try:
            t0 = time.perf_counter()
            unroll()
            rec["first_s"] = round(time.perf_counter() - t0, 1)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                unroll()
                times.append(time.perf_counter() - t0)
            rec["ms"] = round(statistics.median(times) * 1e3, 2)
        except Exception as e:  # noqa: BLE001 -- a kernel this GPU or torch lacks must not cost the others' figures
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        recs.append(rec)
    return recs


def compare(d: Eagle3Drafter, device, paths: dict, kind: str) -> dict:
    """paths: name -> (train.kernels, (batch, teacher, packed-row args)); the first is the reference."""
    out = {}
    for name, (o, (y, teacher, docs)) in paths.items():
        d.zero_grad(set_to_none=True)
        loss, sums = objective_for(d, device, 4, o)(y["aux"], y["input_ids"], y["loss_mask"], teacher, **docs)
        loss.backward()
        out[name] = (loss.detach(), sums, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    ref_loss, ref_sums, ref_grads = out.pop(next(iter(paths)))
    rec = {"kind": kind, "count": ref_sums["count"].tolist()}
    for name, (loss, sums, grads) in out.items():
        rec[name] = {
            "loss_rel": abs(float(loss - ref_loss)) / abs(float(ref_loss)),
            "loss_sum_rel": float(((sums["loss_sum"] - ref_sums["loss_sum"]).abs() / ref_sums["loss_sum"]).max()),
            "correct_equal": bool(torch.equal(sums["correct"], ref_sums["correct"])),
            "grad_rel_max": max(float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items()),
            "grad_rel_over_1pct": {n: round(float((grads[n] - g).norm() / g.norm()), 4) for n, g in ref_grads.items()
                                   if (grads[n] - g).norm() > 0.01 * g.norm()},
            "same_params": sorted(grads) == sorted(ref_grads)}
    return rec


def specforge(args, t: int, emit) -> None:
    """SpecForge's step at length t in its own process (static-shape graphs, as ours get)."""
    sf_out = Path(args.out or "/tmp/bench_train_step.jsonl").with_suffix(".specforge.jsonl")
    sf_out.unlink(missing_ok=True)
    cmd = ([str(Path(__file__).with_name("specforge_full_step.py")), "--harness", args.specforge_harness,
            "--seq-len", str(t), "--warmup", str(args.warmup), "--iters", str(args.iters),
            "--shape", args.specforge_shape]
           if args.with_optimizer else
           [args.specforge_harness, "--configs", f"flex_attention:{t}", "--measure-peak"])
    subprocess.run([sys.executable, *cmd, "--wheel", args.specforge_wheel, "--out", str(sf_out)], check=False)
    for line in sf_out.read_text().splitlines() if sf_out.exists() else []:
        emit({"impl": "specforge", **json.loads(line)})
    if not sf_out.exists():
        emit({"impl": "specforge", "seq_len": t, "error": "no record (see its output above)"})



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--config", default="configs/llama-3.1-8b-instruct.yaml",
                    help="the run config whose train.kernels the variants start from (as train resolves them here)")
    ap.add_argument("--variants", default="config",
                    help="comma list: config (its train.kernels as they are) | flex (attention flex) | ckpt (+ "
                         "activation checkpointing) | fp32_weights (bf16_weights off) | docs (rows of packed "
                         "documents, pack_length = the length; MFU counts the attention they need) | eager (compile "
                         "no) | dense (dense attention, eager: the CPU path)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=784.0)
    ap.add_argument("--parity", nargs="?", const="fp32,bf16,alone", default="",
                    help="the GPU checks to run first, a comma list of fp32 (the fast paths vs the reference), bf16 "
                         "(flash too, under autocast), alone (the flash attention by itself); bare: all three. "
                         "fp32 compiles eleven paths: ~5 min of an H200")
    ap.add_argument("--profile", default="", help="lengths (comma list) at which to print the kernel time table of one step")
    ap.add_argument("--trace-dir", default=None, help="with --profile: also write each profiled step's chrome trace here")
    ap.add_argument("--specforge-wheel", default=None)
    ap.add_argument("--specforge-harness", default=".carry/specforge_step.py")
    ap.add_argument("--specforge-shape", default="8b", choices=("8b", "kimi-k2.5"),
                    help="SpecForge's drafter for the comparison (bench/specforge_full_step.py --shape)")
    ap.add_argument("--losses", default="kl", help="train.loss values to time, each a record (kl,lk_alpha,lk_lambda: "
                                                   "the LK losses' cost as a ratio to kl)")
    ap.add_argument("--with-optimizer", action="store_true",
                    help="time whole training steps: + AdamW (ours) / BF16Optimizer (SpecForge's), see above")
    ap.add_argument("--out", default=None, help="append one JSON line per record")
    ap.add_argument("--attention-only", action="store_true",
                    help="time the K attention calls alone per kernel (flex, flash, cudnn) at --seqlens, and stop")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks this script runs")
    ap.add_argument("--target-config", default="", help="the drafter of this target instead of the 8B shape: its "
                                                        "config dir, e.g. configs/targets/kimi-k2.5")
    ap.add_argument("--draft-attention", default="gqa", choices=("gqa", "mla"), help="with --target-config")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="with --target-config")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    s = (target_shape(args.target_config, args.draft_attention, args.draft_vocab) if args.target_config
         else SMOKE if args.smoke else SHAPE)
    if args.smoke and args.draft_attention == "mla" and not args.target_config:
        s = {**s, "mla": MLAShape(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)}
    seqlens = [int(x) for x in args.seqlens.split(",")]
    args.profile = [int(x) for x in args.profile.split(",") if x]
    kernels = load_config(args.config).train.kernels
    variants = {"config": {}, "flex": {"attention": "flex"}, "ckpt": {"activation_checkpointing": True},
                "fp32_weights": {"bf16_weights": False}, "eager": {"compile": "no"},
                "dense": {"attention": "dense", "compile": "no"}}
    if args.smoke:
        # the CPU path: no bf16 autocast there, so no bf16 weights either
        seqlens = seqlens if args.seqlens != ap.get_default("seqlens") else [64]
        args.warmup, args.iters = 1, 2
        variants = {"dense": {**variants["dense"], "bf16_weights": False}}

    def kernels_for(name: str, t: int) -> TrainKernels:
        if name == "docs":  # packed rows take flex (cuDNN's kernel takes one document per row)
            return dataclasses.replace(kernels, pack_length=t, attention="flex")
        return dataclasses.replace(kernels, **variants[name])

    records = []

    def emit(rec):
        records.append(rec)
        print("RESULT", json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    args.seqlens = seqlens
    if args.attention_only:
        for rec in attention_alone(args, s, device):
            emit(rec)
        return
    if args.parity and device.type == "cuda":
        for rec in parity(args, device):
            emit(rec)
    for t in seqlens:  # length by length, SpecForge then ours: a run cut short still leaves whole pairs
        if args.specforge_wheel:
            specforge(args, t, emit)
        for name in args.variants.split(",") if not args.smoke else variants:
            for loss in args.losses.split(","):
                emit(bench_or_error(args, s, t, name, kernels_for(name, t), device, loss))
    print_table(records)


def bench_or_error(args, s: dict, t: int, name: str, kernels: TrainKernels, device, loss: str = "kl") -> dict:
    """One variant's record, or its error: one variant's failure (OOM, a compile error) must not cost the others'."""
    try:
        return bench(args, s, t, name, kernels, device, loss)
    except torch.OutOfMemoryError as e:
        return {"impl": "eagle3", "variant": name, "seq_len": t, "error": "OOM", "detail": str(e)[:200]}
    except Exception as e:  # noqa: BLE001 -- see the docstring
        return {"impl": "eagle3", "variant": name, "seq_len": t, "error": type(e).__name__, "detail": str(e)[:300]}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def print_table(records: list[dict]) -> None:
    sf = {r["seq_len"]: r for r in records if r.get("impl") == "specforge" and "tokens_per_s" in r}
    print("\n| seq | impl | tok/s | peak GiB | MFU | vs SpecForge |")
    print("|---|---|---|---|---|---|")
    for r in records:
        if "seq_len" not in r:
            continue
        name = r["impl"] if r["impl"] == "specforge" else f"eagle3 {r['variant']}" + (
            f" {r['head_loss']}" if r.get("head_loss", "kl") != "kl" else "")
        if "tokens_per_s" not in r:
            print(f"| {r['seq_len']} | {name} | {r.get('error', 'failed')} | | | |")
            continue
        base = sf.get(r["seq_len"])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and r["impl"] != "specforge" else ""
        print(f"| {r['seq_len']} | {name} | {r['tokens_per_s']:,.0f} | {r.get('peak_mem_gib', '-')} | "
              f"{r['mfu']:.1%} | {ratio} |")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
