"""`make demo`: run generate -> extract -> train -> eval for one config, timing each stage.

    python scripts/demo.py --config configs/smollm2-135m-instruct.yaml [--run-dir DIR] [key=value ...]

The stages run one after another in this process (each is exactly `python -m <stage>`'s main; one
interpreter saves ~4 s of imports per stage on a 2-core machine).

Sizes follow the machine, so that the demo ends in ~20 min on 2 cores: the config's (1216 samples, 5 epochs) on
a GPU or a CPU with native bf16 and fast fp32 matmul; MEDIUM on a CPU with native bf16 and slower fp32;
COMPACT_FAST or COMPACT without native bf16, by its fp32 rate (README's demo table has the times). key=value
arguments override any.
"""

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.run.cli import run_main, set_threads, setup_logging, stage_parser  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.run.errors import UserError  # noqa: E402
from eval.llamacpp_build import cached_server_binary  # noqa: E402

# torch (and core.target.model, which imports it) is imported where the machine is measured or the stages run:
# `--show-sizes --assume` needs neither (0.2 CPU-s a call instead of 3.1).

FULL_SPEED_GFLOPS = 230.0  # fp32 matmul on 2 cores from which the config's sizes fit the demo's time
MEDIUM = ["data_gen.num_samples=1024", "train.epochs=5"]  # native bf16, slower fp32: data_gen decodes in bf16
# Without native bf16 the fp32 rate decides, K=2 TTT (its steps cost ~3/4 of K=3's) and 6 epochs in both tiers:
# at the same CPU time these read a higher τ than fewer epochs at K=3, and 768 x 6 the τ of 1,024 x 5 for ~4/5 of
# the time (docs/PERFORMANCE.md, findings).
COMPACT = ["data_gen.num_samples=448", "train.epochs=6", "train.ttt_steps=2"]
FAST_FP32_GFLOPS = 160.0  # a real AVX2 EPYC at 138 ran the 768-prompt tier in 22:38 (docs/PERFORMANCE.md): over the 20 min
COMPACT_FAST = ["data_gen.num_samples=768", *COMPACT[1:]]


def fp32_matmul_gflops(seconds: float = 0.5) -> float:
    """The best timing of a 1024x1024 fp32 matmul repeated for `seconds`: what the CPU can do, not what one
    moment gave (a best of 3 read on both sides of FAST_FP32_GFLOPS on one idle host; 0.5 s of repeats is stable)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best / 1e9


def sizes_for(gflops: float, native_bf16: bool) -> list[str]:
    """[] (the config's sizes) on a fast CPU with native bf16; MEDIUM on a slower one with native bf16; without
    it COMPACT_FAST where fp32 is fast, else COMPACT."""
    if native_bf16:
        return [] if gflops >= FULL_SPEED_GFLOPS else MEDIUM
    return COMPACT_FAST if gflops >= FAST_FP32_GFLOPS else COMPACT


def machine_sizes(gflops: float | None = None, native_bf16: bool | None = None) -> list[str]:
    """This machine's sizes (a GPU: the config's), said aloud when smaller; gflops / native_bf16 given: those of a
    CPU with that fp32 matmul rate and native bf16 or not (`--show-sizes --assume`)."""
    if gflops is None:
        import torch

        if torch.cuda.is_available():
            return []
        gflops = fp32_matmul_gflops()
    if native_bf16 is None:
        from core.target.model import resolve_precision

        native_bf16 = resolve_precision("auto") == "bf16"
    sizes = sizes_for(gflops, native_bf16)
    if sizes:
        print(f"demo: this CPU runs fp32 matmul at {gflops:.0f} GFLOP/s{' (native bf16)' if native_bf16 else ' and has no native bf16'}: "
              f"smaller sizes ({' '.join(sizes)}) keep the demo under 20 min; the config's full sizes take ~14 min (native "
              "bf16) to ~39 min (fp32 only) on a 2-core CPU: make demo ARGS=\"data_gen.num_samples=1216 train.epochs=5 "
              "train.ttt_steps=3\"", flush=True)
    return sizes


def tau_every(cfg, probes: int = 3) -> int:
    """Optimizer steps between train's τ probes so that a run makes about `probes` of them (each one costs
    ~30 s of a 2-core CPU), whatever the sizes and batch: train/curves.png's τ panel, not a slower demo."""
    steps = -(-cfg.data_gen.num_samples // cfg.train.batch_size) * cfg.train.epochs
    return max(1, -(-steps // probes))  # the last probe falls on the last step, which train always probes


def demo_overrides(args) -> list[str]:
    """The machine's sizes, then τ on 4 held-out prompts a few times in training (train/curves.png's τ panel),
    then the user's key=value, which win."""
    assume = args.assume.split(",") if args.assume else None
    if assume and (len(assume) != 2 or assume[1] not in ("bf16", "fp32") or not assume[0].replace(".", "", 1).isdigit()):
        raise UserError(f"--assume {args.assume!r}: expected GFLOPS,bf16 or GFLOPS,fp32 (e.g. 125,fp32)")
    sizes = machine_sizes(float(assume[0]), assume[1] == "bf16") if assume else machine_sizes()
    every = tau_every(load_config(args.config, [*sizes, *args.overrides]))
    return [*sizes, f"train.tau_every={every}", "train.tau_new_tokens=32", *args.overrides]


def stage_mains() -> dict:
    """Each stage's main, imported when the demo runs (`--show-sizes` needs none of them: ~2 s less)."""
    from data_gen.generate import main as data_gen_main
    from eval.run import main as eval_main
    from extract.run import main as extract_main
    from train.loop import main as train_main

    return {"data_gen": data_gen_main, "extract": extract_main, "train": train_main, "eval": eval_main}


def main() -> int:
    parser = stage_parser("demo", __doc__)
    parser.add_argument("--show-sizes", action="store_true", help="print the overrides the demo would run with, as "
                        "JSON, and exit")
    parser.add_argument("--assume", default="", help="with --show-sizes: GFLOPS,bf16|fp32 (a CPU's fp32 matmul rate "
                        "and whether it has native bf16) instead of this machine's")
    args = parser.parse_args()
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        args.overrides = demo_overrides(args)
        load_config(args.config, args.overrides)
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    if args.show_sizes:
        print(json.dumps(args.overrides))
        return 0
    from core.target.model import cache_root

    set_threads(cfg.threads)
    if cached_server_binary(cache_root(cfg)) is not None:  # eval also serves the drafter in llama.cpp
        args.overrides = ["eval.engine=llamacpp", *args.overrides]
    times = {}
    for stage, stage_main in stage_mains().items():
        print(f"\n=== {stage} ===", flush=True)
        cfg = load_config(args.config, args.overrides)  # a fresh config per stage, as the CLI builds it
        if args.run_dir:
            cfg.run_dir = args.run_dir
        run_dir = cfg.run_path
        t = time.time()
        rc = run_main(stage, stage_main, cfg, **({} if stage == "eval" else {"fresh": args.fresh}))
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
          f"on {report['num_prompts']} held-out prompts ({report['engine']} engine); speedup {report['speedup']:.2f}x; "
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
