"""Stage wall times by torch thread count, on an idle machine and beside a competing process.

    python bench/bench_threads.py [--threads 1,2] [--config configs/smollm2-135m-instruct.yaml]

Runs data_gen, extract, train and eval through their CLIs at small sizes for each thread count (the
`threads` config key), first alone, then with one busy process (a 1-thread fp32 matmul loop: another
user's job) on the machine. Prints a markdown table: seconds per stage and the ratio to 1 thread
under the same load (the baseline). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("data_gen", "extract", "train", "eval")
SMALL = ["data_gen.num_samples=32", "data_gen.max_new_tokens=48", "train.epochs=1", "eval.max_prompts=4",
         "eval.max_new_tokens=32", "train.wandb_mode=disabled"]
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


def run_stages(config: str, threads: int, run_dir: Path) -> dict[str, float]:
    times = {}
    for stage in STAGES:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", stage, "--config", config, "--run-dir", str(run_dir),
                        f"threads={threads}", *SMALL], cwd=ROOT, check=True, capture_output=True)
        times[stage] = time.perf_counter() - t
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for load in ("idle", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", BUSY]) if load == "busy" else None
            try:
                for n in counts:
                    times = run_stages(args.config, n, Path(tmp) / f"{load}-{n}")
                    rows.append((load, n, times))
                    print(f"{load} threads={n}: " + ", ".join(f"{s} {t:.1f}s" for s, t in times.items()), flush=True)
            finally:
                if busy is not None:
                    busy.kill()
    print("\n| load | threads | " + " | ".join(STAGES) + " | total |\n|---|---|" + "---|" * (len(STAGES) + 1))
    for load, n, times in rows:
        base = next(t for ld, m, t in rows if ld == load and m == counts[0])
        cells = [f"{times[s]:.1f} s ({times[s] / base[s]:.2f}x)" for s in STAGES]
        total, base_total = sum(times.values()), sum(base.values())
        print(f"| {load} | {n} | " + " | ".join(cells) + f" | {total:.0f} s ({total / base_total:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
