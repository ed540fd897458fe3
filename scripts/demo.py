"""`make demo`: run generate -> extract -> train -> eval for one config, timing each stage.

    python scripts/demo.py --config configs/smollm2-135m-instruct.yaml [--run-dir DIR] [key=value ...]

The stages run one after another in this process (each is exactly `python -m <stage>`'s main; one
interpreter saves ~4 s of imports per stage on a 2-core machine).
"""

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.cli import run_main, setup_logging, stage_parser  # noqa: E402
from core.config import load_config  # noqa: E402
from core.target import cache_root  # noqa: E402
from data_gen.generate import main as data_gen_main  # noqa: E402
from eval.llamacpp_server import cached_server_binary  # noqa: E402
from eval.run import main as eval_main  # noqa: E402
from extract.run import main as extract_main  # noqa: E402
from train.loop import main as train_main  # noqa: E402

STAGES = {"data_gen": data_gen_main, "extract": extract_main, "train": train_main, "eval": eval_main}


def main() -> int:
    args = stage_parser("demo", __doc__).parse_args()
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    if cached_server_binary(cache_root(cfg)) is not None:  # eval also serves the drafter in llama.cpp
        args.overrides = ["eval.engine=llamacpp", *args.overrides]
    times = {}
    for stage, stage_main in STAGES.items():
        print(f"\n=== {stage} ===", flush=True)
        cfg = load_config(args.config, args.overrides)  # a fresh config per stage, as the CLI builds it
        if args.run_dir:
            cfg.run_dir = args.run_dir
        run_dir = cfg.run_path
        t = time.time()
        rc = run_main(stage, stage_main, cfg)
        gc.collect()
        times[stage] = time.time() - t
        if rc != 0:
            print(f"demo: stage {stage} failed (exit {rc}); rerun `make demo` to resume where it stopped")
            return rc
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    print("\n=== demo finished ===")
    print("wall time per stage: " + ", ".join(f"{s} {t:.0f}s" for s, t in times.items())
          + f" (total {sum(times.values()):.0f}s)")
    print(f"acceptance length tau = {report['acceptance_length']:.3f} at K={report['draft_steps']} "
          f"on {report['num_prompts']} held-out prompts; speedup {report['speedup']:.2f}x; "
          f"outputs_match_baseline = {report['outputs_match_baseline']}")
    if "server" in report:
        hf = report["hf_engine"]
        print(f"our engine (HF, batch 1): tau = {hf['acceptance_length']:.3f}, speedup {hf['speedup']:.2f}x")
        for lv in report["server"]["levels"]:
            print(f"llama.cpp llama-server, {lv['concurrency']} in flight: tau = {lv['acceptance_length']:.3f}, "
                  f"{lv['base']['tokens_per_s']:.1f} -> {lv['spec']['tokens_per_s']:.1f} tok/s = "
                  f"speedup {lv['speedup']:.2f}x, outputs equal base {lv['outputs_equal']}/{report['num_prompts']}")
    else:
        print("llama.cpp: `make serve-eval` builds llama-server once (~4-6 min) and serves this drafter beside ours")
    print(f"report: {run_dir / 'eval' / 'report.md'}   drafter (SGLang format): {run_dir / 'drafter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
