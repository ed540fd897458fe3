"""python -m train.prune_vocab --drafter DIR --size N --out DIR [--counts sharegpt] [--config CFG]

Why: a drafter's lm_head is most of its weights (SmolLM2's with a 16,384-token draft vocab: 9.4M of 14.6M).
Keeping only the N draft tokens training saw most often (FR-Spec's frequency-ranked head, cut after
training) makes each draft step lighter at a small cost in acceptance: a greedy draft is the full drafter's
whenever that token is kept. It pays where the head bounds the step; in llama.cpp on 2 CPU cores SmolLM2's
draft step is mostly per-call cost, and 16,384 -> 8,192 gained 0-5% for ~1% of τ (docs/PERFORMANCE.md).

Counts: the drafter's own draft_vocab_counts.json (train writes it), or `--counts sharegpt`: ShareGPT's
original assistant answers tokenized with the target's tokenizer, a stand-in for drafters trained before
that file existed (said in the output's manifest).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core.run.cli import run_main, setup_logging
from core.run.config import load_config
from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_json
from core.storage.manifest import MANIFEST, check_compat, fingerprint, read_manifest
from core.target.model import load_tokenizer, target_info
from train.draft_vocab import COUNTS_FILE, counts_record, most_frequent, prune_draft_vocab, target_ids_of

log = logging.getLogger("train")
SHAREGPT_SOURCE = "ShareGPT train-split assistant answers (original text), tokenized by the target's tokenizer"


def sharegpt_counts(cfg, vocab_size: int) -> torch.Tensor:
    """Counts of each target id over ShareGPT's train-split assistant answers: [V]."""
    from core.target.prompts import load_prompts

    tok = load_tokenizer(cfg)
    texts = [m["content"] for p in load_prompts("sharegpt", "train", cfg.data_gen.heldout_percent)
             for m in p.messages if m["role"] == "assistant"]
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(0, len(texts), 512):
        for ids in tok(texts[i:i + 512], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def draft_counts(drafter: Path, sd: dict, how: str, cfg) -> tuple[torch.Tensor, str]:
    """-> (counts per draft index [Vd], their source)."""
    if how == "sharegpt":  # counted with the config's tokenizer: it must be the drafter's target's
        if (drafter / MANIFEST).is_file():
            check_compat(read_manifest(drafter, "train"), {"target": cfg.target.model}, drafter)
        vocab = target_info(cfg).vocab_size
        if sd["t2d"].numel() != vocab:
            raise UserError(f"{drafter}: a drafter for a target vocab of {sd['t2d'].numel()}, but target.model "
                            f"{cfg.target.model!r} has {vocab}: pass --config of the drafter's target")
        return sharegpt_counts(cfg, vocab)[target_ids_of(sd["d2t"])], SHAREGPT_SOURCE
    path = drafter / COUNTS_FILE
    if not path.is_file():
        raise UserError(f"{path} missing (a drafter trained before train wrote it): pass --counts sharegpt")
    rec = json.loads(path.read_text())
    if rec.get("target_ids") != target_ids_of(sd["d2t"]).tolist() or len(rec["counts"]) != sd["d2t"].numel():
        raise UserError(f"{path}: counts of another draft vocab than {drafter / 'model.safetensors'}'s "
                        "(re-export the drafter, or pass --counts sharegpt)")
    return torch.tensor(rec["counts"], dtype=torch.int64), rec["source"]


def prune(drafter: Path, size: int, out: Path, how: str, cfg) -> dict:
    """Write the pruned drafter to `out` (a new dir, renamed into place whole) -> its prune record."""
    drafter, out = Path(drafter), Path(out)
    if out.exists():
        raise UserError(f"{out} exists: prune writes a new drafter dir, it never overwrites one")
    if not (drafter / "model.safetensors").is_file():
        raise UserError(f"{drafter / 'model.safetensors'} missing: not an exported drafter dir")
    sd = load_file(drafter / "model.safetensors")
    counts, source = draft_counts(drafter, sd, how, cfg)
    keep = most_frequent(counts, size)
    record = {"from_draft_vocab": counts.numel(), "to_draft_vocab": size, "counts_source": source,
              "kept_share_of_counts": round(float(counts[keep].sum() / counts.sum().clamp(min=1)), 6)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(prune_draft_vocab(sd, keep), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "eagle3_drafter.json"):
            cfg_json = json.loads((drafter / name).read_text())
            cfg_json["draft_vocab_size"] = size
            atomic_write_json(tmp / name, cfg_json)
        atomic_write_json(tmp / COUNTS_FILE, counts_record(target_ids_of(sd["d2t"])[keep], counts[keep], source))
        if (drafter / MANIFEST).is_file():  # eval reads the target from it
            manifest = json.loads((drafter / MANIFEST).read_text())
            manifest["counts"]["pruned_draft_vocab"] = record
            # another model: eval reports and freshness checks must not take it for the one it came from
            manifest["fingerprint"] = fingerprint({"pruned_from": manifest.get("fingerprint"), "keep": keep.tolist()})
            atomic_write_json(tmp / MANIFEST, manifest)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, type=Path, help="an exported drafter dir (SGLang format)")
    ap.add_argument("--size", required=True, type=int, help="draft tokens to keep")
    ap.add_argument("--out", required=True, type=Path, help="the new drafter dir (must not exist)")
    ap.add_argument("--counts", default="drafter", choices=["drafter", "sharegpt"],
                    help=f"drafter: its {COUNTS_FILE}; sharegpt: ShareGPT's answers as a stand-in")
    ap.add_argument("--config", default="configs/smollm2-135m-instruct.yaml", help="for --counts sharegpt's tokenizer")
    args = ap.parse_args(argv)

    def report(cfg) -> None:
        record = prune(args.drafter, args.size, args.out, args.counts, cfg)
        log.info("%s: draft vocab %d -> %d, keeping %.2f%% of the counted tokens (%s)", args.out,
                 record["from_draft_vocab"], record["to_draft_vocab"], 100 * record["kept_share_of_counts"],
                 record["counts_source"])

    setup_logging()
    return run_main("train.prune_vocab", report, load_config(args.config, []))


if __name__ == "__main__":
    sys.exit(main())
