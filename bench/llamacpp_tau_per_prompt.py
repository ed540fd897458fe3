"""Where our engine's τ and llama.cpp's part: prompt by prompt, both engines' τ at one K and p_min, and whether
the two targets wrote the same greedy tokens.

    python bench/llamacpp_tau_per_prompt.py --drafter results/smollm2-135m-instruct/drafter \
        --config /tmp/gpu_fp32.yaml --prompts ../shared/data/mt_bench/question.jsonl --k 7 --p-min 0.5

Our fp32 target and llama.cpp's converted one round differently; at a near tie their greedy answers part, and from
there each engine's drafter is scored on another text. τ over all prompts then compares different texts, so
the totals are also given over the prompts where our tokens equal llama.cpp's base server's (and its
speculative server's): there the two engines should agree to the draft. llama.cpp's τ per prompt comes from
its /metrics counters read around each request (one request at a time), as bench_llamacpp_spec.py counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.engine.speculative import Drafting, speculative_generate  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.target.chat import eval_prompt_ids  # noqa: E402
from eval.llamacpp_server import complete, served_by_llamacpp, spec_counters  # noqa: E402
from eval.report import common_prefix  # noqa: E402
from eval.run import load_engine  # noqa: E402


def taus(rows: list[dict]) -> tuple[float, float]:
    """(ours, llama.cpp's) τ over rows: ours = tokens / verifications that drafted (1 if none drafted),
    llama.cpp's = 1 + accepted / drafts."""
    rounds = sum(r["ours_rounds"] for r in rows)
    ours = sum(r["ours_tokens"] for r in rows) / rounds if rounds else 1.0
    return ours, 1 + sum(r["accepted"] for r in rows) / max(sum(r["drafts"] for r in rows), 1)


def totals(rows: list[dict]) -> str:
    ours, theirs = taus(rows)
    return f"τ ours {ours:.3f}, llama.cpp {theirs:.3f} ({len(rows)} prompts)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    ap.add_argument("--prompts", default="heldout", help="a prompt file, or heldout: the config's held-out prompts")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--outtype", default="q8_0", help="the drafter GGUF's type")
    ap.add_argument("--target-outtype", default="f32", choices=["q4_1", "f16", "bf16", "f32"])
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    convert = "" if args.target_outtype == "q4_1" else args.target_outtype  # q4_1: the embedded file
    cfg = load_config(args.config, [f"eval.max_prompts={args.max_prompts}", f"eval.draft_steps={args.k}",
                                    f"eval.gguf_outtype={args.outtype}", f"eval.target_outtype={convert}",
                                    f"eval.draft_p_min={args.p_min}"])
    model, tok, drafter, stop = load_engine(cfg, args.drafter)
    items = eval_prompt_ids(cfg, tok, args.prompts)
    rows = []
    with (tempfile.TemporaryDirectory() as tmp,
          served_by_llamacpp(cfg, Path(args.drafter), Path(tmp), 1) as (base, spec)):
        print("| prompt | ours = llama.cpp base | llama.cpp spec = base | first differing token | τ ours | τ llama.cpp |\n"
              "|---|---|---|---|---|---|", flush=True)
        for pid, ids in items:
            ours = speculative_generate(model, drafter, ids, args.max_new_tokens, stop, Drafting(args.k, p_min=args.p_min))
            base_ids = complete(base, ids, args.max_new_tokens)["tokens"]
            before = spec_counters(spec)
            theirs = complete(spec, ids, args.max_new_tokens)["tokens"]
            after = spec_counters(spec)
            drafted = ours.drafting_rounds()
            row = {"same": ours.tokens == base_ids, "spec_same": theirs == base_ids, "ours_tokens": sum(drafted),
                   "ours_rounds": len(drafted), "drafts": after["drafts"] - before["drafts"],
                   "accepted": after["accepted"] - before["accepted"]}
            rows.append(row)
            first = "-" if row["same"] else common_prefix(ours.tokens, base_ids)
            tau_ours, tau_theirs = taus([row])
            print(f"| {pid} | {'yes' if row['same'] else 'no'} | {'yes' if row['spec_same'] else 'no'} | "
                  f"{first} | {tau_ours:.3f} | {tau_theirs:.3f} |", flush=True)
    print(f"all prompts: {totals(rows)}")
    print(f"ours = llama.cpp base: {totals([r for r in rows if r['same']])}")
    print(f"ours = llama.cpp base = llama.cpp spec: {totals([r for r in rows if r['same'] and r['spec_same']])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
