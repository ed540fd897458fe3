#!/usr/bin/env python3
"""SpecForge 0.2.0's whole training step on one GPU: its benchmark harness's step (forward_loss + backward,
../shared/bench/specforge_step.py) followed by SpecForge's own optimizer, `specforge.optimizer.BF16Optimizer`
(gradient-norm clip at 0.5, fp32 master copies of the bf16 weights, AdamW, copy back), as SpecForge trains.

    python3 bench/specforge_full_step.py --wheel .carry/specforge-0.2.0-py3-none-any.whl \
        --harness .carry/specforge_step.py --seq-len 2048 --out /tmp/sf_full.jsonl

The harness leaves the optimizer out, and with it the state that is most of a real step's memory; this
adds it, so `bench/bench_train_step.py --with-optimizer` (one process of this per length) compares whole
steps. Nothing of SpecForge lives here: its model, batch, loss and optimizer come from the harness and the
wheel, imported at run time. Shapes (--shape, K=7, batch 1): `8b`, the harness's defaults (the Llama-3.1-8B
drafter); `kimi-k2.5`, SpecForge's own Kimi-K2.5 draft (its repository's configs/kimi-k25-eagle3.json:
LlamaForCausalLMEagle3, hidden 7168, 64 heads x 128, 64 KV heads, MLP 18,432, vocab 163,840, draft vocab 32,000).
"""

import argparse
import importlib.util
import json
import statistics
import time
from types import SimpleNamespace

import torch

SHAPES = {"8b": SimpleNamespace(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                                draft_vocab=32000, max_pos=131072, ttt=7, batch=1, in_vocab=1.0),
          "kimi-k2.5": SimpleNamespace(hidden=7168, intermediate=18432, heads=64, kv_heads=64, head_dim=128,
                                       vocab=163840, draft_vocab=32000, max_pos=131072, ttt=7, batch=1, in_vocab=1.0)}


def load_harness(path: str):
    spec = importlib.util.spec_from_file_location("specforge_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--harness", default=".carry/specforge_step.py")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=784.0)
    ap.add_argument("--out", default=None, help="append the JSON record here")
    args = ap.parse_args()
    harness = load_harness(args.harness)
    harness.add_wheel_to_path(args.wheel)
    from specforge.optimizer import BF16Optimizer

    t, device, shape = args.seq_len, "cuda", SHAPES[args.shape]
    _, model, strategy, draft_ids = harness.build(shape, "flex_attention", device, torch.bfloat16)
    batch = harness.make_batch(shape, t, device, torch.bfloat16, draft_ids)
    opt = BF16Optimizer(model, lr=1e-5, max_grad_norm=0.5, total_steps=1000, warmup_ratio=0.0)

    def timed() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        strategy.forward_loss(batch).loss.backward()
        opt.step()  # clips, steps the fp32 masters, copies them into the bf16 weights, grads to None
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rec = {"impl": "specforge", "shape_name": args.shape, "optimizer": "BF16Optimizer", "backend": "flex_attention",
           "batch": shape.batch, "seq_len": t, "ttt": shape.ttt}
    try:
        rec["warmup_s"] = [round(timed(), 2) for _ in range(args.warmup)]
        torch.cuda.reset_peak_memory_stats()
        times = [timed() for _ in range(args.iters)]
    except torch.OutOfMemoryError as e:  # a record, so the comparison's table says so
        emit({**rec, "error": "OOM", "detail": str(e)[:200]}, args.out)
        return
    med = statistics.median(times)
    flops = harness.model_flops_per_step(B=shape.batch, T=t, K=shape.ttt, H=shape.hidden, I=shape.intermediate,
                                         nh=shape.heads, nkv=shape.kv_heads, hd=shape.head_dim,
                                         Vd=shape.draft_vocab)["per_step_total"]
    rec.update(step_ms_median=round(med * 1e3, 2), step_ms_min=round(min(times) * 1e3, 2),
               tokens_per_s=round(shape.batch * t / med, 1), mfu=round(flops / med / (args.peak_tflops * 1e12), 4),
               peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
               weights_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    emit(rec, args.out)


def emit(rec: dict, out: str | None) -> None:
    print("RESULT", json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
