#!/usr/bin/env python3
"""The training loop a user runs, at Kimi-K2.5's real shape: shards on disk -> loader -> step -> optimizer ->
checkpoint, beside the step alone (bench/bench_train_step.py) at the same shape, length and kernels (GPU).

    python bench/bench_train_loop.py --work /tmp/kimi-loop --draft-attention gqa --length 16384 --samples 16
    python bench/bench_train_loop.py --work /tmp/kimi-loop --lengths thinking --samples 400 --no-train
    python bench/bench_train_loop.py --smoke --work /tmp/smoke     # CPU, tiny widths: the same path in seconds

What it does, in order:
1. A target dir: Kimi-K2.5's config.json (configs/targets/kimi-k2.5) with random embedding, LM head and final
   norm under its `language_model.` names, which is all that training reads of a target.
2. Hidden shards written by extract's own ShardWriter as configs/kimi-k2.5.yaml stores them (fp8 e4m3, final
   rows on loss spans) with its manifest: aux [T, 3 x 7168], final [T, 7168], token ids in the 163,840 vocab.
   Values are random, scaled like a DeepSeek-V3 residual stream: aux layers at RMS 0.3 / 2 / 8 (it grows with
   depth), each with 4 massive-activation features at 50x, final (after the norm) at RMS 1. Loss mask: a prompt
   of 5-15% of the sample, then the answer. Lengths: --length N (every sample N tokens: the loop against the
   step) or --lengths thinking (the n quantiles of core/run/measured.THINKING, the distribution `make plan`
   sums its hours over, shuffled).
3. The disk's sequential read rate (a 2 GiB file written here, then dropped from the page cache) and the
   loader's read rate (train's own read-ahead over the shards, dropped from the cache first), side by side.
4. `python -m train --config configs/kimi-k2.5.yaml` on them, one epoch, a log line a step (the shards dropped
   from the page cache first, as a 740 GiB set would never be cached): tokens/s from train/throughput.jsonl over
   the steps after --skip (compilation), peak GPU memory, the epoch-end checkpoint's size and write time.
5. bench_train_step.py --with-optimizer at the same shape, length and kernels, in its own process.
-> `loop / step = X` and RESULT lines (--out: JSON lines).

--kill-in-checkpoint instead trains with a checkpoint every 2 steps, kill -9s the run while its second
checkpoint is being written, and reruns it: the rerun must resume from the first (printed, and the exit code).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.run.config import load_config  # noqa: E402
from core.run.measured import THINKING  # noqa: E402
from core.storage.hidden_shards import ShardWriter  # noqa: E402
from core.storage.manifest import write_manifest  # noqa: E402
from core.target.aux_layers import resolve_aux_layers  # noqa: E402
from core.target.hidden_capture import capture_compat  # noqa: E402
from core.target.model import target_info  # noqa: E402
from train.data import ShardDataset, collate, read_ahead  # noqa: E402

KIMI = ROOT / "configs/targets/kimi-k2.5/config.json"
CONFIG = ROOT / "configs/kimi-k2.5.yaml"
# smoke: Kimi-K2.5's layout (61 layers, MLA, the wrapper) at toy widths
SMOKE_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=1024)
AUX_RMS = (0.3, 2.0, 8.0)  # aux layers 3 / 31 / 59: the residual stream grows with depth
def thinking_lengths(n: int) -> list[int]:
    """The distribution's n quantiles, in a fixed shuffled order (batches of mixed lengths, as a run sees them)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    q = THINKING.quantiles(n)
    return [q[i] for i in order]


def make_target(out: Path, smoke: bool, device: torch.device, weights: bool = True) -> Path:
    """Kimi-K2.5's config (toy widths with smoke) + random embed / lm_head / final norm in bf16 (drawn on device;
    weights=False: the config alone, which is all that writing shards reads)."""
    from safetensors.torch import save_file

    cfg = json.loads(KIMI.read_text())
    cfg.pop("quantization_config", None)
    if smoke:
        cfg["text_config"].update(SMOKE_TEXT)
    text = cfg["text_config"]
    done = (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg
    if done and ((out / "model.safetensors").is_file() or not weights):
        return out
    out.mkdir(parents=True, exist_ok=True)
    if not weights:
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out
    h, v = text["hidden_size"], text["vocab_size"]
    g = torch.Generator(device=device).manual_seed(0)
    weights = {"language_model.model.embed_tokens.weight":
               (torch.randn(v, h, generator=g, device=device) * 0.02).bfloat16().cpu(),
               "language_model.lm_head.weight": (torch.randn(v, h, generator=g, device=device) * h ** -0.5).bfloat16().cpu(),
               "language_model.model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def run_config(target: Path, run_dir: Path, smoke: bool, extra: list[str]):
    over = [f"target.model={target}", f"run_dir={run_dir}", "train.wandb_mode=disabled", *extra]
    if smoke:
        over += ["train.draft_vocab_size=256", "train.max_len=512", "target.device=cpu"]
    return over, load_config(CONFIG, over)


def make_shards(cfg, lengths: list[int], device: torch.device) -> Path:
    """Shards as extract writes them for cfg (ShardWriter + the finished manifest train checks)."""
    out, info = cfg.run_path / "hidden", target_info(cfg)
    aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.num_layers)
    compat = {**capture_compat(cfg, info, aux_layers), "dtype": cfg.extract.dtype, "spans": cfg.extract.spans}
    settings = {"conversations": f"bench_train_loop {lengths[:4]}... x{len(lengths)}", **compat}
    h, v = info.hidden_size, info.vocab_size
    g = torch.Generator(device=device).manual_seed(1)
    massive = torch.randint(0, h, (3, 4), generator=g, device=device)
    with ShardWriter(out, h, cfg.extract.dtype, cfg.extract.shard_mb, cfg.extract.spans) as writer:
        for i, t in enumerate(lengths):
            sid = f"bench-{i:06d}"
            if sid in writer.done:
                continue
            aux = torch.randn(t, 3, h, generator=g, device=device)
            for layer, rms in enumerate(AUX_RMS):
                aux[:, layer] *= rms
                aux[:, layer, massive[layer]] *= 50
            final = torch.randn(t, h, generator=g, device=device)
            prompt = max(1, int(t * (0.05 + 0.1 * torch.rand(1, generator=g, device=device).item())))
            loss_mask = torch.ones(t, dtype=torch.uint8)
            loss_mask[:prompt] = 0
            ids = torch.randint(0, v, (t,), generator=g, device=device).cpu()
            writer.add(sid, ids, loss_mask, aux.reshape(t, 3 * h), final)
    write_manifest(out, "extract", cfg, compat, {"samples": len(lengths)}, {"conversations": "bench"}, settings)
    return out


def drop_cache(paths) -> None:
    """Evict files from the page cache (their pages are clean: written and synced), so reads hit the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_rate(work: Path, gib: float) -> float:
    """GB/s of one sequential read of a file written here, out of the page cache."""
    path = work / "disk-probe.bin"
    block = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(int(gib * 64)):
            f.write(block)
    drop_cache([path])
    start, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            n += len(chunk)
    rate = n / (time.perf_counter() - start) / 1e9
    path.unlink()
    return rate


def loader_read_rate(hidden: Path, max_len: int) -> float:
    """GB/s of shard bytes through train's reader (read, checksums, collate), one sample a batch, out of the cache."""
    from core.storage.hidden_shards import HiddenShards

    shards = HiddenShards(hidden)
    files = sorted(hidden.glob("shard-*.safetensors"))
    drop_cache(files)
    ds = ShardDataset(shards, shards.ids, max_len)
    start = time.perf_counter()
    for _ in read_ahead(lambda i: collate([ds[i]]), list(range(len(ds))), 2):
        pass
    return sum(f.stat().st_size for f in files) / (time.perf_counter() - start) / 1e9


def train(over: list[str], work: Path, log_name: str, env=None) -> subprocess.Popen:
    log = open(work / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "train", "--config", str(CONFIG), *over], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def loop_figures(cfg, log_text: str, skip: int) -> dict:
    rows = [json.loads(x) for x in (cfg.run_path / "train/throughput.jsonl").read_text().splitlines()]
    kept = rows[skip:] or rows[-1:]
    rec = {"steps_timed": len(kept), "tokens_per_s": round(sum(r["tokens"] for r in kept) /
                                                          sum(r["seconds"] for r in kept), 1),
           "first_steps_s": [r["seconds"] for r in rows[:skip]]}
    peak = re.search(r"peak GPU memory of this process: ([\d.]+) GiB", log_text)
    ckpt = re.findall(r"checkpoint (step-\d+): ([\d.]+) GiB in ([\d.]+) s", log_text)
    if peak:
        rec["peak_gib"] = float(peak.group(1))
    if ckpt:
        rec["checkpoint"] = {"name": ckpt[-1][0], "gib": float(ckpt[-1][1]), "seconds": float(ckpt[-1][2])}
    return rec


def step_alone(args, length: int) -> dict:
    """bench_train_step.py at the loop's shape, length and kernels (its own process: its own compile)."""
    out = Path(args.work) / f"step-{args.draft_attention}-{length}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench/bench_train_step.py"), "--config", str(CONFIG), "--with-optimizer",
           "--seqlens", str(length), "--variants", "ckpt" if args.ckpt else "config", "--warmup", "2", "--iters", str(args.iters),
           "--draft-attention", args.draft_attention, "--out", str(out)]
    target = Path(args.work) / "target-smoke" if args.smoke else KIMI.parent
    cmd += ["--target-config", str(target), "--draft-vocab", str(args.draft_vocab)] + (["--smoke"] if args.smoke else [])
    subprocess.run(cmd, cwd=ROOT, check=False)
    recs = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return next((r for r in recs if "tokens_per_s" in r), {"error": recs[-1] if recs else "no record"})


def kill_in_checkpoint(over: list[str], cfg, work: Path) -> dict:
    """kill -9 while the second checkpoint is written; the rerun must resume from the first."""
    over = [*over, "train.save_every=2", "train.stop_after=4"]
    ckpts = cfg.run_path / "train/checkpoints"
    shutil.rmtree(ckpts, ignore_errors=True)  # an earlier run's step-0000004 would end the wait below at once
    proc = train([*over, "--fresh"], work, "kill.log")
    second = ckpts / "step-0000004"
    while proc.poll() is None and not any(second.glob("*")):
        time.sleep(0.05)
    time.sleep(0.2)  # inside save_state's writes
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = json.loads((ckpts / "latest.json").read_text())
    rerun = train(over, work, "rerun.log")
    rerun.wait()
    text = (work / "rerun.log").read_text()
    return {"killed_while_writing": second.name, "kill_landed_mid_write": latest["path"] != second.name,
            "latest_after_kill": latest["path"],
            "rerun_resumed_from": (re.findall(r"resumed from (step-\d+)", text) or [None])[0],
            "rerun_exit": rerun.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="where the target, shards and runs go")
    ap.add_argument("--draft-attention", default="gqa", choices=("gqa", "mla"))
    ap.add_argument("--length", type=int, default=16384, help="every sample this many tokens")
    ap.add_argument("--lengths", default="", help="thinking: core/run/measured.THINKING's lengths instead of --length")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the loop's tokens/s (compilation)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps of the step-alone benchmark")
    ap.add_argument("--ckpt", action="store_true", help="with activation checkpointing (train.kernels."
                                                        "activation_checkpointing; the step alone: variant ckpt)")
    ap.add_argument("--no-train", action="store_true", help="shards and read rates only")
    ap.add_argument("--no-step", action="store_true", help="no step-alone benchmark")
    ap.add_argument("--kill-in-checkpoint", action="store_true")
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.draft_vocab = 256 if args.smoke else load_config(CONFIG).train.draft_vocab_size
    if args.smoke:
        args.length, args.samples, args.skip, args.iters, args.disk_gib = 256, 6, 1, 2, 0.0625
    lengths = thinking_lengths(args.samples) if args.lengths == "thinking" else [args.length] * args.samples
    if args.smoke and args.lengths == "thinking":
        lengths = [min(t, 512) for t in lengths]
    target = make_target(work / ("target-smoke" if args.smoke else "target"), args.smoke, device, not args.no_train)
    name = f"run-{args.draft_attention}-{args.lengths or args.length}{'-ckpt' if args.ckpt else ''}"
    over, cfg = run_config(target, work / name, args.smoke,
                           [f"train.draft_attention={args.draft_attention}", "train.epochs=1", "train.log_every=1",
                            f"train.kernels.activation_checkpointing={str(args.ckpt).lower()}"])
    rec = {"kind": "train_loop", "draft_attention": args.draft_attention, "activation_checkpointing": args.ckpt,
           "samples": len(lengths),
           "tokens": sum(lengths), "length_mean": round(sum(lengths) / len(lengths), 1), "length_max": max(lengths),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    start = time.perf_counter()
    hidden = make_shards(cfg, lengths, device)
    files = list(hidden.glob("shard-*.safetensors"))
    rec.update(shards_s=round(time.perf_counter() - start, 1), shard_mib=round(sum(f.stat().st_size for f in files) / 2**20, 1),
               disk_read_gbps=round(disk_read_rate(work, args.disk_gib), 2),
               loader_read_gbps=round(loader_read_rate(hidden, cfg.train.max_len), 2))
    print(f"shards: {rec['shard_mib']:,} MiB in {rec['shards_s']} s; read rates: disk {rec['disk_read_gbps']} GB/s, "
          f"loader {rec['loader_read_gbps']} GB/s", flush=True)
    if args.kill_in_checkpoint:
        rec.update(kill_in_checkpoint(over, cfg, work))
    elif not args.no_train:
        drop_cache(files)
        proc = train([*over, "--fresh"], work, f"{name}.log")
        proc.wait()
        text = (work / f"{name}.log").read_text()
        if proc.returncode:
            print(text[-3000:])
            raise SystemExit(f"train exited {proc.returncode}")
        rec["loop"] = loop_figures(cfg, text, args.skip)
        if not args.no_step and len(set(lengths)) == 1:
            rec["step"] = step_alone(args, lengths[0])
            if "tokens_per_s" in rec["step"]:
                rec["loop_over_step"] = round(rec["loop"]["tokens_per_s"] / rec["step"]["tokens_per_s"], 3)
    print("RESULT", json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    if "loop_over_step" in rec:
        print(f"loop / step = {rec['loop_over_step']:.3f} ({rec['loop']['tokens_per_s']:,.0f} / "
              f"{rec['step']['tokens_per_s']:,.0f} tok/s, {args.draft_attention}, {lengths[0]:,} tokens, "
              f"{rec['device']})")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
