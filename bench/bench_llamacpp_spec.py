"""Our drafter in a real engine: llama.cpp's llama-server, base vs EAGLE-3 speculative, beside our HF
engine's τ on the same prompt token ids (greedy; our engine at batch 1, the servers at each --concurrency).

    python bench/bench_llamacpp_spec.py --drafter runs/smollm2-135m-instruct/drafter \
        [--prompts heldout|FILE.jsonl] [--k 2,3,5,7] [--outtype f32,f16,q8_0] [--max-prompts 16] \
        [--target-outtype q4_1|f16|bf16|f32] [--p-min 0,0.5,0.8] [--server-args "--poll 100"] \
        [--spec-args ";--poll 0"] [--concurrency 1,4] [--no-ours]

The target is the embedded SmolLM2 GGUF (Q4_1) that our fp32 target is dequantized from, or
(--target-outtype f16 ...) that dequantized target converted back by llama.cpp's own
convert_hf_to_gguf.py, as the drafter is. Why both: on a few CPU cores a Q4_1 token is bound by the
arithmetic, so verifying K+1 tokens costs about K+1 tokens; an f16 token is bound by reading its
weights, which K+1 tokens share, as a large target's are on a GPU. τ (llama.cpp) = 1 + Δaccepted / Δdrafts from
its /metrics counters; τ (ours) = mean tokens per verification of core.engine.speculative.speculative_generate.
Tokens/s at 1 in flight = the server's own decode timing (predicted_n / predicted_ms), summed over prompts;
at c > 1 in flight (every server started with c slots) = output tokens / wall time of the blocks of c requests
(prompt processing included: decode timings of overlapping requests do not add up to a throughput).
Cost: a speculative cycle (K draft steps + one verification) takes τ / spec tok/s; in base-token
times that is the break-even τ at this K (the τ at which spec is as fast as base). A line fitted
through the K values splits it into a fixed part and a cost per drafted token (draft step + its
share of the verification). --p-min > 0 lets llama.cpp stop drafting at an unsure draft (no draft: a
plain decode step): fewer wasted drafts and verify rows, so its speedup can beat the fixed-K one. Its τ
then counts only the cycles that drafted; ours stops by the same rule (core.engine.speculative.draft_confidence) and
counts the same way; only p_min 0 is fitted.
--server-args go to every server; --spec-args are ';'-separated sets of flags for the speculative servers only,
each set its own servers (e.g. threading flags that would also change the base server's speed, which stays
at llama-server's defaults to compare against).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.engine.speculative import Drafting, acceptance_length, speculative_generate  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.target.chat import eval_prompt_ids  # noqa: E402
from core.target.model import (  # noqa: E402
    cache_root,
    resolve_target,
)
from eval.llamacpp import convert_drafter, convert_to_gguf  # noqa: E402
from eval.llamacpp_build import llamacpp_tree  # noqa: E402
from eval.llamacpp_server import (  # noqa: E402
    LlamaServer,
    SpecDraft,
    build_server,
    spec_counters,
    target_gguf_choice,
)
from eval.run import load_engine  # noqa: E402
from eval.server_eval import taking_turns  # noqa: E402
from eval.spec_counters import counter_window  # noqa: E402


def run_interleaved(urls: list[str], items, n: int, rounds: int, concurrency: int) -> list[dict]:
    """Every server answers every prompt, `rounds` times, `concurrency` requests in flight, the servers taking
    turns block by block (eval's `taking_turns`). -> per server {"outs": its texts (first round), "tps": at 1 in
    flight decode tokens/s from llama.cpp's own timings, else output tokens / wall, over all its answers}."""
    res = [{"outs": None, "tokens": 0, "s": 0.0} for _ in urls]
    for _ in range(rounds):
        done = taking_turns({str(i): u for i, u in enumerate(urls)}, items, n, concurrency, "llamacpp")
        for i, x in enumerate(res):
            rows = done[str(i)]["rows"]
            x["outs"] = x["outs"] or [row["text"] for row in rows]
            if concurrency == 1:
                x["tokens"] += sum(row["timings"]["predicted_n"] for row in rows)
                x["s"] += sum(row["timings"]["predicted_ms"] for row in rows) / 1000
            else:
                x["tokens"] += done[str(i)]["output_tokens"]
                x["s"] += done[str(i)]["wall_s"]
    return [{"outs": x["outs"], "tps": x["tokens"] / x["s"]} for x in res]


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a*x + b -> (a, b)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return a, my - a * mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a drafter dir, or a comma list of them (compared in one run)")
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    ap.add_argument("--prompts", default=None, help="a prompt file, or heldout (the default): the config's held-out ShareGPT prompts")
    ap.add_argument("--k", default="2,3,5,7")
    ap.add_argument("--outtype", default="f32")
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--target-outtype", default="q4_1", choices=["q4_1", "f16", "bf16", "f32"],
                    help="q4_1: the embedded GGUF; else our target converted by llama.cpp's converter")
    ap.add_argument("--p-min", default="0", help="comma list of llama.cpp's --spec-draft-p-min values")
    ap.add_argument("--target-gguf", default="", help="a target GGUF already converted (instead of --target-outtype)")
    ap.add_argument("--server-args", default="", help="more llama-server flags for both servers, e.g. '--poll 100'")
    ap.add_argument("--spec-args", default="", help="';'-separated flag sets for the speculative servers only, "
                    "each set its own servers, e.g. ';--poll 0' (defaults, then --poll 0)")
    ap.add_argument("--rounds", type=int, default=1, help="times each server answers every prompt")
    ap.add_argument("--concurrency", default="1", help="comma list of requests in flight, e.g. 1,4 (each level "
                    "its own rows; every server gets as many slots as the largest)")
    ap.add_argument("--no-ours", action="store_true", help="skip our engine's τ (slow on a CPU)")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"eval.max_prompts={args.max_prompts}"])
    drafters = args.drafter.split(",")
    model, tok, drafter, stop = load_engine(cfg, drafters[0])  # our τ: of the first drafter
    items = eval_prompt_ids(cfg, tok, args.prompts)
    n = args.max_new_tokens
    cache = cache_root(cfg)
    tree = llamacpp_tree(cache)
    binary = build_server(tree, cache)
    tmp = tempfile.TemporaryDirectory()
    convert = "" if args.target_outtype == "q4_1" else args.target_outtype  # q4_1: the embedded file
    target_gguf, convert_at = target_gguf_choice(args.target_gguf, cfg.target.model, convert, convert)
    if target_gguf is None:
        target_gguf = convert_to_gguf(tree, resolve_target(cfg), Path(tmp.name) / f"target-{convert_at}.gguf",
                                      convert_at)
    extra = tuple(args.server_args.split())
    ks = [int(k) for k in args.k.split(",")]
    p_mins = [float(p) for p in args.p_min.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = max(levels)
    ours = {}  # (K, p_min) -> τ over the verifications that drafted, as llama.cpp counts
    for k, p_min in [] if args.no_ours else [(k, p) for p in p_mins for k in ks]:
        ours[k, p_min] = acceptance_length([a for _, ids in items for a in speculative_generate(
            model, drafter, ids, n, stop, Drafting(k, p_min=p_min)).drafting_rounds()])
    with tmp, contextlib.ExitStack() as stack:
        specs = []  # (label, gguf, k, p_min, drafter, flags): one speculative server each, all up beside the base
        for d in drafters:
            for outtype in args.outtype.split(","):
                gguf = convert_drafter(tree, Path(d), resolve_target(cfg), Path(tmp.name) / f"draft{len(specs)}.gguf",
                                       outtype)
                for flags in args.spec_args.split(";"):
                    label = f"{Path(d).name} {outtype} ({gguf.stat().st_size / 1e6:.1f} MB){' ' + flags if flags else ''}"
                    specs += [(label, gguf, k, p, d, tuple(flags.split())) for p in p_mins for k in ks]
        urls = [stack.enter_context(LlamaServer(binary, target_gguf, parallel=slots, extra_args=extra))]
        urls += [stack.enter_context(LlamaServer(binary, target_gguf, SpecDraft(g, k, p), parallel=slots,
                                                 extra_args=extra + flags))
                 for _, g, k, p, _, flags in specs]
        runs = []  # per level: (results, counters before, counters after)
        for c in levels:
            before = [spec_counters(u) for u in urls[1:]]
            res = run_interleaved(urls, items, n, args.rounds, c)
            runs.append((c, res, before, [spec_counters(u) for u in urls[1:]]))
    for c, res, before, after in runs:
        report(c, res, before, after, specs, ours if c == 1 else {}, drafters[0], target_gguf.name, len(items), n,
               args.rounds)
    return 0


def report(c: int, res, before, after, specs, ours, first_drafter, target_name, num_prompts, n, rounds) -> None:
    """One concurrency level's table (and, at p_min 0, the cycle fitted over K)."""
    base_out, base_tps = res[0]["outs"], res[0]["tps"]
    how = "decode (its own timings)" if c == 1 else "output tokens / wall"
    print(f"\n{c} in flight: base llama-server ({target_name}) {base_tps:.1f} tok/s {how}, {num_prompts} prompts x "
          f"<= {n} tokens x {rounds} round(s), taking turns with the {len(specs)} speculative servers", flush=True)
    print("| drafter GGUF | p_min | K | τ llama.cpp | per-position acceptance | τ ours (HF engine) | spec tok/s | speedup "
          "| cycle in base tokens = break-even τ | outputs equal base |\n|---|---|---|---|---|---|---|---|---|---|",
          flush=True)
    fits: dict[str, tuple[list, list]] = {}
    for (label, _, k, p_min, d, _), r, b, a in zip(specs, res[1:], before, after, strict=True):
        # eval's own window; a p_min that stopped every draft made none: τ 1, nothing accepted
        w = counter_window(b, a) if a["drafts"] > b["drafts"] else {"acceptance_length": 1.0,
                                                                     "per_position_acceptance": []}
        tau, pos = w["acceptance_length"], " ".join(f"{x:.2f}" for x in w["per_position_acceptance"])
        same = sum(o == q for o, q in zip(r["outs"], base_out, strict=True))
        cycle = tau * base_tps / r["tps"]
        if p_min == 0:
            fits.setdefault(label, ([], []))[0].append(k)
            fits[label][1].append(cycle)
        ours_tau = f"{ours[k, p_min]:.3f}" if (k, p_min) in ours and d == first_drafter else "-"
        print(f"| {label} | {p_min:g} | {k} | {tau:.3f} | {pos} | {ours_tau} | {r['tps']:.1f} | "
              f"{r['tps'] / base_tps:.2f}x | {cycle:.2f} | {same}/{num_prompts} |", flush=True)
    for label, (xs, ys) in fits.items():
        if len(xs) > 1:
            slope, fixed = linear_fit(xs, ys)
            print(f"{label}: cycle ≈ {fixed:.2f} + {slope:.2f} x K base tokens (fixed part + cost per drafted token)")


if __name__ == "__main__":
    sys.exit(main())
