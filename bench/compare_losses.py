"""train.loss side by side: one run's shards trained once per loss and seed, equal steps, then τ measured where
a user measures it -> a table (markdown + JSON lines) of held-out τ in our engine and llama.cpp and MT-Bench τ.

    python bench/compare_losses.py --source runs/smollm2-135m-instruct --out /tmp/losses \\
        [--losses kl,lk_lambda,lk_alpha] [--seeds 0,1] [--mt-bench ../shared/data/mt_bench/question.jsonl] \\
        [key=value ...]   # overrides for train and eval, e.g. the demo tier's train.epochs=6 train.ttt_steps=2

--source holds conversations/ (and hidden/ where extract ran: offline training); each run dir under --out links
them and trains its own drafter (`python -m train`), then `python -m eval --engine llamacpp --concurrency 1` on the
held-out prompts (our engine and llama-server b11434 on the same drafter) and, with --mt-bench, `python -m eval`
on MT-Bench's first eval.max_prompts questions (our engine). A drafter already trained is not retrained and a run
already evaluated is read, not redone, so a cut-off comparison resumes. The last line per loss: mean and spread
(max - min) over the seeds. --hf-only: held-out τ in our engine only, for more seeds in less time.

One GPU at a larger size: train there, evaluate on a CPU machine with llama.cpp (the same --out):

    python bench/compare_losses.py --config configs/smollm2-135m-instruct-gpu.yaml --source runs/gen --out /tmp/L \
        --seeds 0 --train-only train.epochs=2        # on the GPU (online training: conversations only)
    python bench/compare_losses.py --config configs/smollm2-135m-instruct-gpu.yaml --source runs/gen --out /tmp/L \
        --seeds 0 --mt-bench question.jsonl train.epochs=2 target.dtype=fp32 eval.target_outtype=f32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.run.config import load_config, to_dict  # noqa: E402


def stage(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:1])} exited {proc.returncode}: {proc.stderr[-2000:]}")


def target_gguf(out: Path) -> list[str]:
    """eval.target_gguf=<the target GGUF an earlier run here converted>: the same target, converted once."""
    found = sorted(out.glob("*/eval/llamacpp/target-*.gguf"))
    return [f"eval.target_gguf={found[0]}"] if found else []


def stale_settings(run: Path, config: str, over: list[str]) -> list[str]:
    """The seed and train.* settings where the drafter already in `run` differs from what these flags train
    (its manifest's, as train recorded them): a drafter trained another way must not pass for this one."""
    cfg = load_config(ROOT / config, over)
    want = {"seed": cfg.seed, **{f"train.{k}": v for k, v in to_dict(cfg.train).items()}}
    had = json.loads((run / "drafter/manifest.json").read_text())["settings"]
    return [f"{k}: {had[k]!r} there, {want[k]!r} here" for k in had
            if k in want and json.loads(json.dumps(want[k])) != had[k]]


def train_run(source: Path, run: Path, config: str, overrides: list[str]) -> float | None:
    """Train the run's drafter unless it is there already, trained with these settings (a --train-only pass
    elsewhere, or a cut-off comparison); one trained otherwise stops the comparison."""
    if (run / "drafter/model.safetensors").exists() and (run / "train/metrics.jsonl").exists():
        if stale := stale_settings(run, config, overrides):
            raise SystemExit(f"{run}/drafter was trained otherwise ({'; '.join(stale)}): remove {run} or use "
                             "another --out")
        return None
    run.mkdir(parents=True, exist_ok=True)
    for name in ("conversations", "hidden"):  # hidden/ only where the source extracted (offline training)
        if (source / name).exists() and not (run / name).exists():
            (run / name).symlink_to((source / name).resolve())
    start = time.perf_counter()
    stage("train", *stage_flags(config, run, overrides))
    return round(time.perf_counter() - start, 1)


def run_overrides(loss: str, seed: int, over: list[str]) -> list[str]:
    return [f"seed={seed}", f"train.loss={loss}", "train.wandb_mode=disabled", *over]


def stage_flags(config: str, run: Path, overrides: list[str]) -> list[str]:
    return ["--config", config, "--run-dir", str(run), *overrides]


def eval_run(run: Path, loss: str, seed: int, flags: list[str], train_s: float | None, mt_bench: str | None,
             hf_only: bool) -> dict:
    stage("eval", *flags, *([] if hf_only else [*target_gguf(run.parent), "--engine", "llamacpp", "--concurrency", "1"]))
    report = json.loads((run / "eval/report.json").read_text())
    metrics = [json.loads(x) for x in (run / "train/metrics.jsonl").read_text().splitlines()]
    ours = report.get("hf_engine", report)  # --engine llamacpp reports ours beside llama.cpp's levels
    rec = {"loss": loss, "seed": seed, "train_s": train_s, "steps": metrics[-1]["step"],
           "tau_ours": ours["acceptance_length"], "outputs_match": ours["outputs_match_baseline"],
           "train_tau_alpha": metrics[-1].get("tau_alpha"), "train_acc_0": metrics[-1]["acc_0"]}
    if not hf_only:
        rec.update(tau_llamacpp=report["server"]["levels"][0]["acceptance_length"],
                   llamacpp_outputs_equal=report["server"]["levels"][0]["outputs_equal"])
    if mt_bench and not hf_only:
        stage("eval", *flags, "--prompts", mt_bench, "--out", str(run / "eval-mt-bench"))
        mt = json.loads((run / "eval-mt-bench/report.json").read_text())
        rec.update(tau_mt_bench=mt["acceptance_length"], mt_bench_outputs_match=mt["outputs_match_baseline"])
    (run / "result.json").write_text(json.dumps(rec))
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
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    ap.add_argument("--losses", default="kl,lk_lambda,lk_alpha")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--mt-bench", default=None)
    ap.add_argument("--hf-only", action="store_true", help="held-out τ in our engine only (no llama.cpp, no MT-Bench)")
    ap.add_argument("--train-only", action="store_true", help="train every run, evaluate none (a later call does)")
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at once (offline runs on a CPU or GPU; three online SmolLM2 runs ran one 80 GB GPU out of memory)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out, source = Path(args.out), Path(args.source)
    runs = [(loss, int(seed), out / f"{loss}-seed{seed}") for seed in args.seeds.split(",")
            for loss in args.losses.split(",")]
    todo = [r for r in runs if not (r[2] / "result.json").exists()]
    overrides = {run: run_overrides(loss, seed, args.overrides) for loss, seed, run in runs}
    with ThreadPoolExecutor(args.jobs) as pool:
        trained = pool.map(lambda r: train_run(source, r[2], args.config, overrides[r[2]]), todo)
        train_s = dict(zip([r[2] for r in todo], trained, strict=True))
    if args.train_only:
        print(json.dumps({str(run): s for run, s in train_s.items()}))
        return
    recs = []
    for loss, seed, run in runs:
        done = run / "result.json"
        rec = (json.loads(done.read_text()) if done.exists()
               else eval_run(run, loss, seed, stage_flags(args.config, run, overrides[run]), train_s.get(run),
                            args.mt_bench, args.hf_only))
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    text = table(recs)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
