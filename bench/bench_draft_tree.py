"""Chain vs EAGLE-2 tree at the same number of drafted tokens per verification, on a trained drafter
in our HF engine (greedy, batch 1): τ, tokens/s and speedup against the plain target decode.

    python bench/bench_draft_tree.py --drafter runs/smollm2-135m-instruct/drafter \
        [--prompts heldout|FILE.jsonl] [--pairs 4:2,4,4 6:3,4,6] [--max-prompts 16]

Each pair `K:depth,topk,total` runs a chain of K drafts and a tree of `total` nodes (K == total: the
same drafted tokens go to the target per verification). Every output is checked equal to greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.drafters.draft_tree import TreeSpec  # noqa: E402
from core.engine.decode import generate  # noqa: E402
from core.engine.speculative import Drafting, speculative_generate  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.target.chat import eval_prompt_ids  # noqa: E402
from eval.run import load_engine  # noqa: E402


def timed_tokens(fn, items) -> tuple[list, float]:
    t = time.perf_counter()
    outs = [fn(ids) for _, ids in items]
    return outs, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    ap.add_argument("--prompts", default=None, help="prompt file (default: the config's held-out prompts)")
    ap.add_argument("--pairs", nargs="+", default=["4:2,4,4", "6:3,4,6"])
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    cfg = load_config(args.config, [f"eval.max_prompts={args.max_prompts}"])
    model, tok, drafter, stop = load_engine(cfg, args.drafter)
    n = args.max_new_tokens
    items = eval_prompt_ids(cfg, tok, args.prompts)
    speculative_generate(model, drafter, items[0][1], 4, stop, Drafting(2, TreeSpec(2, 2, 3)))  # warm-up
    base, t_base = timed_tokens(lambda ids: generate(model, [ids], n, stop)[0].tokens, items)
    base_tps = sum(map(len, base)) / t_base
    print(f"baseline: {base_tps:.1f} tok/s, {len(items)} prompts x <= {n} tokens ({args.prompts or 'heldout'})")
    print("| drafted per verification | drafting | τ | per-depth acceptance | tok/s | speedup | outputs equal greedy |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for pair in args.pairs:
        k, shape = int(pair.split(":")[0]), pair.split(":")[1]
        tree = TreeSpec(*(int(x) for x in shape.split(",")))
        if tree.total != k:
            raise SystemExit(f"--pairs {pair}: tree total {tree.total} != chain K {k}: not the same drafted tokens")
        for name, spec in ((f"chain K={k}", None), (f"tree depth {tree.depth}, top-{tree.topk}", tree)):
            outs, t = timed_tokens(lambda ids, spec=spec, k=k: speculative_generate(model, drafter, ids, n, stop,
                                                                                   Drafting(k, spec)), items)
            lengths = [a for o in outs for a in o.accept_lengths]
            depth = spec.depth if spec else k
            pos = " ".join(f"{sum(a > i + 1 for a in lengths) / len(lengths):.2f}" for i in range(depth))
            tps = sum(len(o.tokens) for o in outs) / t
            same = sum(o.tokens == b for o, b in zip(outs, base, strict=True))
            print(f"| {k} | {name} | {sum(lengths) / len(lengths):.3f} | {pos} | {tps:.1f} | {tps / base_tps:.2f}x | "
                  f"{same}/{len(items)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
