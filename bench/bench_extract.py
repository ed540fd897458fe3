"""hf-engine extraction throughput, shards written to local disk, as a ratio against the FLOP bound.

    python bench/bench_extract.py --config configs/smollm2-135m-instruct.yaml --device cuda
    python bench/bench_extract.py --random-llama-8b --device cuda --storage fp8_e4m3

Runs extract's own loop (extract.run.extract_hf: token-budget batches, one forward with hidden
states, ShardWriter with its checks, atomic shard commits) over synthetic samples whose lengths are
spread over [seq/2, seq] like real conversations. --random-llama-8b builds a random-weight model of
Llama-3.1-8B's shape on the device (nothing downloaded). The FLOP bound counts 2 x (decoder matmul
params) per token plus causal attention (2 x layers x H x T^2 per sample), over the bf16 matmul peak
measured in the same run; the disk figure is shard bytes committed per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import matmul_peak, sync  # noqa: E402
from core.run.config import load_config  # noqa: E402
from core.storage.hidden_shards import ShardWriter  # noqa: E402
from core.target.aux_layers import resolve_aux_layers  # noqa: E402
from core.target.model import load_target, resolve_dtype, resolve_precision  # noqa: E402
from extract.run import extract_hf  # noqa: E402


def random_llama_8b(device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)


def synthetic_rows(n_tokens: int, seq: int, vocab: int, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids, masks, total = [], [], 0
    while total < n_tokens:
        t = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
        ids.append(torch.randint(0, vocab, (t,), generator=g).tolist())
        masks.append([0] * (t // 3) + [1] * (t - t // 3))
        total += t
    return Dataset.from_dict({"id": [f"s{i}" for i in range(len(ids))], "input_ids": ids, "loss_mask": masks})


class Discard:
    """Stands in for extract_hf's progress bar, and for its shard writer when timing the forward alone."""

    def update(self, n):
        pass

    def add(self, *args, **kwargs):
        pass


def forward_only_s(model, rows, aux_layers: list[int], batch_tokens: int, precision: str) -> float:
    """The same loop and batches with nothing copied or written: the compute share."""
    sync(model.device)
    start = time.perf_counter()
    extract_hf(model, rows, [len(x) for x in rows["input_ids"]], aux_layers, Discard(), Discard(), batch_tokens,
               precision)
    sync(model.device)
    return time.perf_counter() - start


def disk_write_gbps(root: Path, n_bytes: int = 2**30) -> float:
    """Sequential write + fsync of n_bytes to the shard disk: the bound for any writer."""
    block = os.urandom(64 * 2**20)
    path = root / "disk_probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n_bytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return n_bytes / elapsed / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--random-llama-8b", action="store_true", help="random weights, Llama-3.1-8B shapes")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16", help="target.dtype: fp32 | bf16 | fp16")
    p.add_argument("--tokens", type=int, default=262144, help="tokens extracted in the timed run")
    p.add_argument("--seq", type=int, default=2048, help="longest sample")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--shard-mb", type=int, default=256, help="shard size (extract.shard_mb)")
    p.add_argument("--storage", default="bf16", help="extract.dtype: bf16 | fp8_e4m3 | fp32")
    p.add_argument("--out", default=None, help="shard dir on the disk to measure (default: a temp dir)")
    args = p.parse_args()

    cfg = load_config(args.config, [f"target.device={args.device}", f"target.dtype={args.dtype}"])
    if args.random_llama_8b:
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        model, name = random_llama_8b(device, resolve_dtype(args.dtype)), "random Llama-3.1-8B shape"
    else:
        (model, _), name = load_target(cfg), cfg.target.model
    c = model.config
    aux_layers = resolve_aux_layers(None, c.num_hidden_layers)
    precision = resolve_precision("auto")  # bf16 autocast on GPUs and native-bf16 CPUs, as extract's `auto`
    peak = matmul_peak(model.device, torch.bfloat16 if precision == "bf16" else model.dtype)
    matmul_params = sum(w.numel() for n, w in model.model.named_parameters() if w.dim() == 2 and "embed" not in n)

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_extract_"))
    warm = synthetic_rows(args.batch_tokens, args.seq, c.vocab_size, seed=1)
    rows = synthetic_rows(args.tokens, args.seq, c.vocab_size)
    lengths = [len(x) for x in rows["input_ids"]]
    flops = sum(2 * matmul_params * t + 2 * c.num_hidden_layers * c.hidden_size * t * t for t in lengths)

    for tag, data in (("warmup", warm), ("timed", rows)):
        shutil.rmtree(root / tag, ignore_errors=True)
        n = [len(x) for x in data["input_ids"]]
        sync(model.device)
        start = time.perf_counter()
        with ShardWriter(root / tag, c.hidden_size, args.storage, shard_mb=args.shard_mb) as writer:
            extract_hf(model, data, n, aux_layers, writer, Discard(), args.batch_tokens, precision)
        sync(model.device)
        elapsed = time.perf_counter() - start
    written = sum(f.stat().st_size for f in (root / "timed").glob("shard-*.safetensors"))
    tps = sum(lengths) / elapsed
    t_fwd = forward_only_s(model, rows, aux_layers, args.batch_tokens, precision)
    disk = disk_write_gbps(root)
    print(f"{name} on {model.device} ({args.dtype}, aux layers {aux_layers}), {len(lengths)} samples / "
          f"{sum(lengths):,} tokens of {args.seq // 2}-{args.seq}, batch_tokens {args.batch_tokens}, "
          f"{args.storage} shards of {args.shard_mb} MB:")
    print(f"extract: {tps:,.0f} tok/s = {flops / elapsed / peak:.1%} of the FLOP bound "
          f"({sum(lengths) / (flops / peak):,.0f} tok/s at the measured peak {peak / 1e12:.1f} TFLOP/s); "
          f"shards {written / sum(lengths) / 1e3:.1f} KB/token, {written / elapsed / 1e9:.2f} GB/s committed "
          f"to {root}")
    print(f"  forward alone {sum(lengths) / t_fwd:,.0f} tok/s ({flops / t_fwd / peak:.1%} of the FLOP bound); "
          f"disk {disk:.2f} GB/s with fsync = {disk * 1e9 / (written / sum(lengths)):,.0f} tok/s of these shards; "
          f"extract reaches {tps / min(sum(lengths) / t_fwd, disk * 1e9 * sum(lengths) / written):.0%} of "
          "min(forward alone, disk)")
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
