"""train.loss side by side: one run's shards trained once per loss and seed, equal steps, then τ measured where
a user measures it -> a table (markdown + JSON lines) of held-out τ in our engine and llama.cpp and MT-Bench τ.

    python bench/compare_losses.py --source runs/smollm2-135m-instruct --out /tmp/losses \\
        [--losses kl,lk_lambda,lk_alpha] [--seeds 0,1] [--mt-bench ../shared/data/mt_bench/question.jsonl] \\
        [key=value ...]   # overrides for train and eval, e.g. the demo tier's train.epochs=6 train.ttt_steps=2

--hf-only: held-out τ in our engine only, for more seeds in less time. --source holds conversations/ and hidden/ (data_gen and extract ran there); each run dir under --out links them
and trains its own drafter (`python -m train`), then `python -m eval --engine llamacpp --concurrency 1` on the
held-out prompts (our engine and llama-server b11434 on the same drafter) and, with --mt-bench, `python -m eval`
on MT-Bench's first eval.max_prompts questions (our engine). A run already evaluated is read, not redone, so a
cut-off comparison resumes. The last line per loss: mean and spread (max - min) over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stage(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:1])} exited {proc.returncode}: {proc.stderr[-2000:]}")


def target_gguf(out: Path) -> list[str]:
    """eval.target_gguf=<the target GGUF an earlier run here converted>: the same target, converted once."""
    found = sorted(out.glob("*/eval/llamacpp/target-*.gguf"))
    return [f"eval.target_gguf={found[0]}"] if found else []


def one_run(source: Path, run: Path, loss: str, seed: int, mt_bench: str | None, over: list[str],
            hf_only: bool = False) -> dict:
    done = run / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    run.mkdir(parents=True, exist_ok=True)
    for name in ("conversations", "hidden"):
        if not (run / name).exists():
            (run / name).symlink_to((source / name).resolve())
    flags = ["--config", "configs/smollm2-135m-instruct.yaml", "--run-dir", str(run), f"seed={seed}",
             f"train.loss={loss}", "train.wandb_mode=disabled", *over]
    start = time.perf_counter()
    stage("train", *flags)
    train_s = time.perf_counter() - start
    stage("eval", *flags, *([] if hf_only else [*target_gguf(run.parent), "--engine", "llamacpp", "--concurrency", "1"]))
    report = json.loads((run / "eval/report.json").read_text())
    metrics = [json.loads(x) for x in (run / "train/metrics.jsonl").read_text().splitlines()]
    ours = report.get("hf_engine", report)  # --engine llamacpp reports ours beside llama.cpp's levels
    rec = {"loss": loss, "seed": seed, "train_s": round(train_s, 1), "steps": metrics[-1]["step"],
           "tau_ours": ours["acceptance_length"], "outputs_match": ours["outputs_match_baseline"],
           "train_tau_alpha": metrics[-1].get("tau_alpha"), "train_acc_0": metrics[-1]["acc_0"]}
    if not hf_only:
        rec.update(tau_llamacpp=report["server"]["levels"][0]["acceptance_length"],
                   llamacpp_outputs_equal=report["server"]["levels"][0]["outputs_equal"])
    if mt_bench and not hf_only:
        stage("eval", *flags, "--prompts", mt_bench, "--out", str(run / "eval-mt-bench"))
        mt = json.loads((run / "eval-mt-bench/report.json").read_text())
        rec.update(tau_mt_bench=mt["acceptance_length"], mt_bench_outputs_match=mt["outputs_match_baseline"])
    done.write_text(json.dumps(rec))
    return rec


def table(recs: list[dict]) -> str:
    keys = [k for k in ("tau_ours", "tau_llamacpp", "tau_mt_bench", "train_tau_alpha") if any(k in r for r in recs)]
    lines = ["| loss | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for loss in dict.fromkeys(r["loss"] for r in recs):
        rs = [r for r in recs if r["loss"] == loss]
        cells = []
        for k in keys:
            v = [r[k] for r in rs if k in r]
            cells.append(f"{statistics.mean(v):.3f} ({min(v):.3f}-{max(v):.3f}, n={len(v)})" if v else "-")
        lines.append(f"| {loss} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--losses", default="kl,lk_lambda,lk_alpha")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--mt-bench", default=None)
    ap.add_argument("--hf-only", action="store_true", help="held-out τ in our engine only (no llama.cpp, no MT-Bench)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out, recs = Path(args.out), []
    for seed in (int(s) for s in args.seeds.split(",")):
        for loss in args.losses.split(","):
            rec = one_run(Path(args.source), out / f"{loss}-seed{seed}", loss, seed, args.mt_bench, args.overrides,
                          args.hf_only)
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    text = table(recs)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
