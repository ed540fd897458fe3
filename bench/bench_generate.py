"""Batched generation speed (core/decode.generate, data_gen's hf backend) against the memory-bandwidth
bound, eager and replayed as CUDA graphs, beside HF `model.generate`; fails if the paths disagree.

    python bench/bench_generate.py --target smollm2-135m-instruct --dtype bf16 \
        --batch 1 16 64 256 --prompt-len 128 --new-tokens 128 --out bench_generate.json

Paths: eager (data_gen.compile=no: every kernel launched from Python, the loop without graphs),
graphs (data_gen.compile=yes, CUDA only), fused (data_gen.compile=fused: torch.compile, then graphs on CUDA;
its rows equal to eager are reported, not required: fused bf16 arithmetic rounds differently), exact
(data_gen.compile=exact: torch.compile fusing only what rounds as eager does, then graphs on CUDA; its
tokens must equal eager's, as the graphs path's must), bf16
(data_gen.mixed_precision=bf16 on a float32 target: the prompt pass under autocast, the steps on a bf16 copy
of the weights; its rows equal to eager reported, not required; its bound counts bf16 weights), hf
(`model.generate`, greedy, its dynamic cache). Random prompts of prompt-len/2..prompt-len tokens, left padded; no stop ids, so every row decodes
new-tokens; T=0. A call is timed whole (prefill, graph capture, decode; what data_gen waits for),
warm-up excluded (its seconds shown as "1st s"), median of --repeats; decode ms/step leaves out a prefill timed alone. The bound:
a decode step reads every weight once and each row's K/V up to its length, at --bandwidth GB/s
(default: a large copy on the device). Exits 1 if the graphs or exact path's tokens differ from the eager
path's (compared once every path has run, in any order; not compared without --paths eager).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import copy_bandwidth, measured, sync, timed  # noqa: E402
from core.engine.decode import DecodeRun, bf16_copy, generate, left_padded, new_cache, prefill  # noqa: E402
from core.engine.decode_step import FUSE_MODES  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.run.errors import UserError  # noqa: E402
from core.target.model import load_target  # noqa: E402


def bound_seconds(model, lengths: list[int], new: int, bandwidth: float) -> float:
    """Decode steps 1..new-1 at `bandwidth` bytes/s: step s reads the weights once and, per row, the K/V
    of its prompt and s generated tokens."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize  # bytes per token
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(weights + kv * sum(n + s for n in lengths) for s in range(1, new)) / bandwidth


def one_path(model, path: str, prompts: list[list[int]], new: int, decoder=None):
    """-> a function generating the tokens of every row along `path` (bf16: `decoder` runs the steps)."""
    if path == "bf16":
        return lambda: [g.tokens for g in generate(model, prompts, new, [], run=DecodeRun(bf16_prefill=True, decode_model=decoder))]
    if path != "hf":
        fuse = path if path in FUSE_MODES else ""
        graphs = path == "graphs" or (bool(fuse) and model.device.type == "cuda")
        return lambda: [g.tokens for g in generate(model, prompts, new, [], run=DecodeRun(graphs=graphs, fuse=fuse))]
    ids, mask, _ = left_padded(prompts, model.device)
    return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0)[:, ids.shape[1]:].tolist()


def first_call_clocked(fn, device):
    """fn -> (fn with its first call's seconds appended to the list returned: the warm-up, which captures the
    CUDA graph and, for fused / exact, compiles)."""
    first = []

    def call():
        if first:
            return fn()
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        first.append(time.perf_counter() - t0)
        return out

    return call, first


def random_prompts(model, b: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(b)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (b,), generator=g).tolist()
    return [torch.randint(100, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def profile_decode(model, b: int, prompt_len: int, new: int = 32) -> None:
    """Where decode's GPU time goes, by kernel: one eager call (prefill + `new` steps; a CUDA graph
    replays the very same kernels, without the launch gaps)."""
    run = one_path(model, "eager", random_prompts(model, b, prompt_len), new)
    run()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"profile of one eager call at batch {b}, prompts of {prompt_len // 2}-{prompt_len} tokens, {new} new:")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))


def bench_batch(model, paths: list[str], b: int, prompt_len: int, new: int, bandwidth: float, repeats: int,
                decoder=None) -> list[dict]:
    prompts = random_prompts(model, b, prompt_len)
    lengths = [len(x) for x in prompts]
    ids, mask, pos = left_padded(prompts, model.device)

    def prefill_s(steps) -> float:  # the prompt pass alone, into the cache the steps use
        with torch.inference_mode():
            return timed(lambda: prefill(model, new_cache(steps, ids.shape[1] + new), ids, mask, pos,
                                         bf16=steps is not model, cache_dtype=steps.dtype), model.device)

    t_prefill = {"model": prefill_s(model), "bf16": prefill_s(decoder) if "bf16" in paths else None}
    rows, tokens = [], {}
    for path in paths:
        steps, t_pre = (decoder, t_prefill["bf16"]) if path == "bf16" else (model, t_prefill["model"])
        row = {"path": path, "batch": b, "prompt_len": prompt_len, "new_tokens": new}
        run, first = first_call_clocked(one_path(model, path, prompts, new, decoder), model.device)
        try:
            tokens[path], t = measured(run, model.device, repeats)
        except UserError as e:  # a graph capture that failed: reported, and the run exits 1
            rows.append({**row, "error": str(e)})
            continue
        decode, bound = max(t - t_pre, 1e-9), bound_seconds(steps, lengths, new, bandwidth)
        rows.append({**row, "first_call_s": first[0], "s_per_call": t, "tok_s": b * new / t, "decode_ms_per_step": 1e3 * decode / max(1, new - 1),
                     "bound_s": bound, "of_bound": bound / decode})
    return [{**r, "rows_equal_eager": rows_equal(tokens.get(r["path"]), tokens.get("eager"))} for r in rows]


def rows_equal(tokens: list[list[int]] | None, eager: list[list[int]] | None) -> int | None:
    """Rows whose tokens equal the eager path's, counted once every path has run (whatever the order of
    --paths); None when either path did not run."""
    if tokens is None or eager is None:
        return None
    return sum(x == y for x, y in zip(tokens, eager, strict=True))


MUST_EQUAL = ("graphs", "exact")  # the paths that promise the eager loop's tokens


def mismatch(row: dict) -> bool:
    """A row of a MUST_EQUAL path whose tokens were compared with the eager path's and differ."""
    return row["path"] in MUST_EQUAL and row["rows_equal_eager"] not in (None, row["batch"])


def report(rows: list[dict]) -> str:
    lines = [f"{'path':7}{'batch':>6}{'prompt':>7}{'new':>5}{'1st s':>8}{'s/call':>9}{'tok/s':>10}{'ms/step':>9}"
             f"{'of bound':>9}  tokens"]
    for r in rows:
        head = f"{r['path']:7}{r['batch']:>6}{r['prompt_len']:>7}{r['new_tokens']:>5}"
        if "error" in r:
            lines.append(f"{head}  FAILED: {r['error']}")
            continue
        same = r["rows_equal_eager"]
        tokens = ("" if r["path"] == "eager" else "not compared (no eager path)" if same is None
                  else f"{same}/{r['batch']} rows equal eager" + (" MISMATCH" if mismatch(r) else ""))
        lines.append(f"{head}{r['first_call_s']:>8.1f}{r['s_per_call']:>9.3f}{r['tok_s']:>10.0f}{r['decode_ms_per_step']:>9.2f}"
                     f"{r['of_bound']:>9.1%}  {tokens}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="alias or local HF model dir (core/target/model.py)")
    p.add_argument("--dtype", default="fp32", help="target.dtype: fp32 | bf16 | fp16")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--paths", nargs="+", choices=["eager", "graphs", "fused", "exact", "bf16", "hf"], default=None,
                   help="default: eager, graphs (CUDA only) and hf")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=0.0, help="peak GB/s; 0 = measure a large copy")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--profile", type=int, default=0, help="first print the kernel time table of decode at this "
                                                          "batch size (CUDA)")
    args = p.parse_args()
    cfg = load_config(None, [f"target.model={args.target}", f"target.dtype={args.dtype}", f"target.device={args.device}"])
    model, _ = load_target(cfg)
    cuda = model.device.type == "cuda"
    paths = args.paths or (["eager", "graphs", "hf"] if cuda else ["eager", "hf"])
    if "graphs" in paths and not cuda:
        p.error("--paths graphs needs a CUDA device")
    if "bf16" in paths and model.dtype != torch.float32:
        p.error("--paths bf16 is data_gen's bf16 decode of an fp32 target: pass --dtype fp32")
    decoder = bf16_copy(model) if "bf16" in paths else None
    bandwidth = args.bandwidth * 1e9 or copy_bandwidth(model.device)
    name = torch.cuda.get_device_name(model.device) if cuda else f"{torch.get_num_threads()} threads"
    print(f"{args.target} {model.dtype} on {model.device} ({name}), bandwidth {bandwidth / 1e9:.0f} GB/s"
          f"{'' if args.bandwidth else ' (copy)'}; bound = weights + K/V up to each length, read once a step")
    if args.profile and cuda:
        profile_decode(model, args.profile, args.prompt_len)
    rows = [r for b in args.batch for r in bench_batch(model, paths, b, args.prompt_len, args.new_tokens, bandwidth,
                                                        args.repeats, decoder)]
    print(report(rows))
    bad = [r for r in rows if r["path"] in MUST_EQUAL and ("error" in r or mismatch(r))]
    if args.out:
        Path(args.out).write_text(json.dumps({"target": args.target, "dtype": args.dtype, "device": str(model.device),
                                              "device_name": name, "bandwidth_gbs": bandwidth / 1e9,
                                              "equal_eager": not bad if "eager" in paths else None,
                                              "rows": rows}, indent=1) + "\n")
    if bad:
        sys.exit(f"FAIL: {' and '.join(sorted({r['path'] for r in bad}))} differs from the eager path (or failed) "
                 f"at batch {sorted({r['batch'] for r in bad})}")
    for path in MUST_EQUAL:
        if {path, "eager"} <= set(paths):
            print(f"{path} == eager token for token at every batch size (T=0)")


if __name__ == "__main__":
    main()
