"""`make demo`: run generate -> extract -> train -> eval for one config, timing each stage.

    python scripts/demo.py --config configs/smollm2-135m-instruct.yaml [--run-dir DIR] [key=value ...]
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.cli import stage_parser  # noqa: E402
from core.config import load_config  # noqa: E402


def main() -> int:
    args = stage_parser("demo", __doc__).parse_args()
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else cfg.run_path
    flags = ["--config", args.config, "--run-dir", str(run_dir), *args.overrides]
    times = {}
    for stage in ("data_gen", "extract", "train", "eval"):
        print(f"\n=== {stage} ===", flush=True)
        t = time.time()
        rc = subprocess.call([sys.executable, "-m", stage, *flags])
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
    print(f"report: {run_dir / 'eval' / 'report.md'}   drafter (SGLang format): {run_dir / 'drafter'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
