"""Pruning a trained drafter's draft vocab (train/prune_vocab.py): the kept rows keep their logits, the most
frequent tokens are the ones kept, SGLang's real loader takes the result, and bad calls change nothing."""

import json

import pytest
import torch
from safetensors.torch import load_file

from core.drafters.drafter import DraftCache, Eagle3Drafter
from tests.sglang_source import check_drafter_tensor_names, run_sglang_load_weights
from tests.test_drafter import VD, B, T, batch, make_drafter
from train.draft_vocab import COUNTS_FILE, counts_record
from train.prune_vocab import main

CONFIG = "configs/tiny-random-llama.yaml"


def exported(tmp_path, counts) -> tuple[Eagle3Drafter, object]:
    d = make_drafter()
    out = tmp_path / "drafter"
    d.save_pretrained(out)
    (out / COUNTS_FILE).write_text(json.dumps(counts_record(d.draft_to_target(torch.arange(VD)), counts, "test")))
    (out / "manifest.json").write_text(json.dumps({"stage": "train", "compat": {"target": "t"}, "counts": {"steps": 3},
                                                     "fingerprint": "f0"}))
    return d, out


def test_pruned_drafter_keeps_the_frequent_rows_and_their_logits(tmp_path):
    counts = torch.randperm(VD) * 7  # distinct: the top 12 are the draft indices of counts >= (VD - 12) * 7
    d, src = exported(tmp_path, counts)
    out = tmp_path / "pruned"
    assert main(["--drafter", str(src), "--size", "12", "--out", str(out), "--config", CONFIG]) == 0
    keep = torch.nonzero(counts >= (VD - 12) * 7).flatten()
    p = Eagle3Drafter.from_pretrained(out, d.embed_tokens.weight.data, "llama", 8)
    full = Eagle3Drafter.from_pretrained(src, d.embed_tokens.weight.data, "llama", 8)
    assert p.config.draft_vocab_size == 12 and json.loads((out / "config.json").read_text())["draft_vocab_size"] == 12
    assert torch.equal(p.draft_to_target(torch.arange(12)), full.draft_to_target(keep))
    assert torch.equal(torch.nonzero(p.t2d).flatten(), full.draft_to_target(keep))
    aux, ids, _, _ = batch()
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        a, _ = full(aux, ids, pos, DraftCache(T))
        b, _ = p(aux, ids, pos, DraftCache(T))
    assert torch.equal(b, a[..., keep])  # the same numbers: only rows were dropped
    pruned = json.loads((out / COUNTS_FILE).read_text())
    assert pruned["counts"] == counts[keep].tolist()
    assert pruned["target_ids"] == full.draft_to_target(keep).tolist()  # pruning the pruned drafter reads them
    tensors = load_file(str(out / "model.safetensors"))
    assert check_drafter_tensor_names(tensors) == []
    hot = run_sglang_load_weights(tensors)["hot_token_id"]  # SGLang 0.5.23's own load_weights
    assert torch.equal(hot, full.draft_to_target(keep))
    manifest = json.loads((out / "manifest.json").read_text())  # eval reads the drafter's target from it
    assert manifest["compat"] == {"target": "t"} and manifest["counts"]["steps"] == 3
    assert manifest["fingerprint"] != "f0"  # another drafter: eval must not record it as the one it came from
    assert manifest["counts"]["pruned_draft_vocab"] == {
        "from_draft_vocab": VD, "to_draft_vocab": 12, "counts_source": "test",
        "kept_share_of_counts": round(float(counts[keep].sum() / counts.sum()), 6)}


def test_prune_refuses_bad_calls_and_leaves_files_alone(tmp_path, capsys):
    d, src = exported(tmp_path, torch.arange(VD))
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    out = tmp_path / "pruned"
    assert main(["--drafter", str(src), "--size", str(VD), "--out", str(out), "--config", CONFIG]) == 1
    assert f"must be in [1, {VD - 1}]" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    assert main(["--drafter", str(src), "--size", "8", "--out", str(out), "--config", CONFIG]) == 1
    assert "never overwrites" in capsys.readouterr().err and not any(out.iterdir())
    (src / COUNTS_FILE).unlink()
    assert main(["--drafter", str(src), "--size", "8", "--out", str(tmp_path / "p2"), "--config", CONFIG]) == 1
    err = capsys.readouterr().err
    assert "--counts sharegpt" in err and len(err.strip().splitlines()) == 1
    assert {f.name: f.read_bytes() for f in src.iterdir()} == {k: v for k, v in before.items() if k != COUNTS_FILE}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind


@pytest.mark.parametrize("size", [1, VD - 1])
def test_prune_edge_sizes(tmp_path, size):
    _, src = exported(tmp_path, torch.arange(VD))
    out = tmp_path / "pruned"
    assert main(["--drafter", str(src), "--size", str(size), "--out", str(out), "--config", CONFIG]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["lm_head.weight"].shape[0] == size and int(tensors["t2d"].sum()) == size


def test_sharegpt_counts_refuse_a_config_of_another_target(tmp_path, capsys):
    """--counts sharegpt tokenizes with the config's target: a drafter of another target would be ranked by
    another tokenizer's ids and pruned wrong with exit 0, so it is refused before anything is counted."""
    _, src = exported(tmp_path, torch.arange(VD))
    args = ["--drafter", str(src), "--size", "8", "--counts", "sharegpt", "--config", CONFIG]
    assert main([*args, "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "target = 't' but this run expects 'tiny-random-llama'" in err and not (tmp_path / "a").exists()
    (src / "manifest.json").unlink()  # no manifest to name the target: the vocab size still tells
    assert main([*args, "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "target vocab of 100" in err and "49152" in err and not (tmp_path / "b").exists()


def test_counts_of_another_draft_vocab_are_refused(tmp_path, capsys):
    """A counts file beside a drafter it was not written for (same size, other tokens) would rank the wrong
    tokens with exit 0: its target ids must be the drafter's."""
    d, src = exported(tmp_path, torch.arange(VD))
    rec = json.loads((src / COUNTS_FILE).read_text())
    rec["target_ids"] = rec["target_ids"][::-1]
    (src / COUNTS_FILE).write_text(json.dumps(rec))
    assert main(["--drafter", str(src), "--size", "8", "--out", str(tmp_path / "p"), "--config", CONFIG]) == 1
    assert "counts of another draft vocab" in capsys.readouterr().err and not (tmp_path / "p").exists()
