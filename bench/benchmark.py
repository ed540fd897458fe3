"""Per-stage speed as a ratio against a limit (the machine's measured matmul peak = FLOP bound).

    python bench/benchmark.py [--stage generate|decode|extract|train|all] [--config configs/<name>.yaml]
                                [--device cpu|cuda] [--dtype fp32|bf16]

generate: batched cached decode tokens/s vs the FLOP bound (2 x params per token), and vs
          `model.generate` on the same batch (why the engine is a plain cached loop)
decode:   eval's batch-1 greedy baseline tokens/s vs the memory-bandwidth bound (every weight read
          once per token), and the speculative cycle: one target token, one verification of K+1
          tokens, one draft step (a drafter of the target's shape) -> the tau a speedup needs
extract:  prefill-with-hidden-states tokens/s vs the FLOP bound
train:    one TTT training step (fwd+bwd) tokens/s and model FLOP utilisation
Random inputs of the real shapes; warm-up excluded; median of repeats. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.engine.decode import decode_one, generate, new_cache, prefill, verify  # noqa: E402
from core.engine.speculative import Drafting, draft_chain  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.target.model import load_target  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measured(fn, device, repeats: int = 3):
    """-> (the warm-up call's result, median seconds of `repeats` more calls)."""
    result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return result, statistics.median(times)


def timed(fn, device, repeats=3) -> float:
    return measured(fn, device, repeats)[1]


def matmul_peak(device, dtype) -> float:
    """Best of several square matmul sizes (small CPU sizes under-report the sustained rate)."""
    best = 0.0
    for n in ((4096, 8192) if device.type == "cuda" else (1024, 2048, 3072)):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        best = max(best, 2 * n**3 / timed(lambda a=a, b=b: a @ b, device, repeats=5))
    return best


def bench_generate(model, peak, batch=16, prompt_len=64, new=32):
    device = model.device
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(100, 20000, (batch, prompt_len)).tolist()
    t_prefill = timed(lambda: model(torch.tensor(prompts, device=device)), device)
    t_ours = timed(lambda: generate(model, prompts, new, stop_ids=[]), device) - t_prefill
    ours = batch * new / t_ours
    bound = peak / (2 * params)
    print(f"generate: cached loop {ours:.0f} tok/s at batch {batch} = {ours / bound:.1%} of FLOP bound "
          f"{bound:.0f} tok/s ({2 * params / 1e9:.2f} GFLOP/token)")
    x = torch.tensor(prompts, device=device)
    t_hf = timed(lambda: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False), device) - t_prefill
    print(f"generate: model.generate {batch * new / t_hf:.0f} tok/s -> cached loop / generate = {t_hf / t_ours:.2f}x")


def copy_bandwidth(device) -> float:
    """Bytes/s of a large tensor copy (read + write), the rate a batch-1 decode streams weights at."""
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / timed(lambda: y.copy_(x), device, repeats=5)


def target_shaped_drafter(cfg, model, vd: int):
    """A drafter of the target's shape (train's own build_drafter) over the first `vd` token ids, its
    default aux layers -> (drafter on the model's device, target head, draft_ids, t2d)."""
    from core.target.model import load_target_embeddings
    from train.loop import build_drafter

    target = load_target_embeddings(cfg)
    draft_ids = torch.arange(vd)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:vd] = True
    n = model.config.num_hidden_layers
    return build_drafter(cfg, [2, n // 2, n - 3], draft_ids, t2d, target).to(model.device), target, draft_ids, t2d


def bench_decode(cfg, model, prompt_len=128, new=64, k=5):
    from core.drafters.drafter import DraftCache

    device = model.device
    prompt = torch.randint(100, 20000, (prompt_len,)).tolist()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = copy_bandwidth(device) / weight_bytes
    t = timed(lambda: generate(model, [prompt], new, stop_ids=[]), device)
    t_prefill = timed(lambda: model(torch.tensor([prompt], device=device)), device)
    tps = (new - 1) / (t - t_prefill)
    print(f"decode: greedy batch 1 {tps:.1f} tok/s = {tps / bound:.1%} of the bandwidth bound {bound:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB of weights per token)")
    d = target_shaped_drafter(cfg, model, 4096)[0].to(dtype=model.dtype).eval()
    max_len = prompt_len + 2 * (k + 1)
    cache, dcache = new_cache(model, max_len), DraftCache(max_len)
    with torch.inference_mode():
        _, aux = prefill(model, cache, torch.tensor([prompt], device=device), aux_layers=d.config.aux_layers)
        logits, h = d(aux, torch.tensor([prompt], device=device), torch.arange(prompt_len, device=device)[None], dcache)
        tok = torch.tensor([prompt[-1]], device=device)

        def one_token():
            decode_one(model, cache, tok, prompt_len)

        def one_verify():
            verify(model, cache, prompt[:k + 1], prompt_len, d.config.aux_layers)

        def drafts():
            dcache.rollback(prompt_len)
            draft_chain(d, logits[:, -1], h[:, -1:], prompt_len, dcache, Drafting(k))

        t_tok, t_ver, t_draft = (timed(f, device, repeats=7) for f in (one_token, one_verify, drafts))
    cycle = t_ver + t_draft
    print(f"decode: cycle at K={k}: target token {t_tok * 1e3:.1f} ms, verify of {k + 1} tokens {t_ver * 1e3:.1f} ms "
          f"({t_ver / t_tok:.2f}x a token), {k} draft steps {t_draft * 1e3:.1f} ms ({t_draft / k / t_tok:.2f}x a token "
          f"each) -> break-even tau {cycle / t_tok:.2f}, tau for 1.5x {1.5 * cycle / t_tok:.2f}")


def bench_extract(model, peak, batch=4, seq=512):
    device = model.device
    params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.lm_head.weight.numel()
    x = torch.randint(100, 20000, (batch, seq), device=device)
    with torch.inference_mode():
        t = timed(lambda: model.model(input_ids=x, output_hidden_states=True), device)
    tps = batch * seq / t
    bound = peak / (2 * params)
    print(f"extract: prefill+hidden {tps:.0f} tok/s at {batch}x{seq} = {tps / bound:.1%} of FLOP bound "
          f"{bound:.0f} tok/s (no lm_head)")


def bench_train(cfg, model, peak, batch=4, seq=512, steps=5, vd=8192):
    from train.ttt_loss import StepOptions, TTTObjective, teacher_argmax_lse, teacher_targets

    device, h = model.device, model.config.hidden_size
    d, target, draft_ids, t2d = target_shaped_drafter(cfg, model, vd)
    head = target.lm_head.to(device)
    obj = TTTObjective(d, steps, 0.8)
    aux = torch.randn(batch, seq, 3 * h, device=device)
    final = torch.randn(batch, seq, h, device=device)
    ids = torch.randint(0, vd, (batch, seq), device=device)
    mask = torch.ones(batch, seq, dtype=torch.uint8, device=device)
    draft_head, tt = head[draft_ids.to(device)], t2d.to(device)
    argmax, lse = teacher_argmax_lse(final, head)  # precomputed once per sample in train, as here

    def step(objective=obj):
        loss, _ = objective(aux, ids, mask, teacher_targets(final, mask, draft_head, tt, argmax, None, lse))
        loss.backward()

    t = timed(step, device)
    # the demo's rows: about half prompt (no loss), where eager steps >= 1 skip the rows no later step counts
    mask[:, : seq // 2] = 0
    plain = timed(step, device)
    pruned = timed(lambda: step(TTTObjective(d, steps, 0.8, StepOptions(prune_rows=True))), device)
    print(f"train: half-prompt rows, steps >= 1 on the counted rows only (prune_rows, the eager default): "
          f"{plain * 1e3:.0f} -> {pruned * 1e3:.0f} ms = {plain / pruned:.2f}x")
    mm = sum(p.numel() for n_, p in d.named_parameters() if p.dim() == 2 and "embed" not in n_)
    mm_fc = d.fc.weight.numel()
    attn = 2 * seq * d.config.num_attention_heads * d.config.head_dim  # QK^T + PV per token (causal ~half, counted full)
    flops_tok = 3 * (2 * (mm - mm_fc) * steps + 2 * mm_fc + attn * steps) + 2 * h * vd  # fwd+bwd + draft-vocab teacher
    tokens = batch * seq
    print(f"train: TTT K={steps} step {t * 1e3:.0f} ms, {tokens / t:.0f} tok/s, "
          f"MFU {flops_tok * tokens / t / peak:.1%} of measured matmul peak ({flops_tok / 1e9:.2f} GFLOP/token)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all", choices=["generate", "decode", "extract", "train", "all"])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32", help="target.dtype: fp32 | bf16 | fp16")
    args = p.parse_args()
    cfg = load_config(args.config, [f"target.device={args.device}", f"target.dtype={args.dtype}"])
    model, _ = load_target(cfg)
    peak = matmul_peak(model.device, model.dtype)
    print(f"device {model.device} dtype {model.dtype} threads {torch.get_num_threads()}: "
          f"measured matmul peak {peak / 1e9:.1f} GFLOP/s")
    if args.stage in ("generate", "all"):
        bench_generate(model, peak)
    if args.stage in ("decode", "all"):
        bench_decode(cfg, model)
    if args.stage in ("extract", "all"):
        bench_extract(model, peak)
    if args.stage in ("train", "all"):
        bench_train(cfg, model, peak)


if __name__ == "__main__":
    main()
