"""τ during training (issue 13): logged beside loss_k / acc_k in metrics.jsonl, W&B and curves.png, and
equal to what eval's engine measures on the exported drafter with the same prompts, K and length."""

import dataclasses
import json
import shutil

import matplotlib.image
import pytest
import torch

from core.drafters.drafter import Eagle3Drafter
from core.run.errors import UserError
from core.storage.atomic_io import read_jsonl
from core.target.chat import eval_prompt_ids
from core.target.model import load_target_embeddings, load_tokenizer, target_info
from eval.run import hf_eval
from tests.conftest import ROOT
from train.tau_probe import TauProbe


def test_tau_is_logged_at_its_steps_to_metrics_wandb_and_the_plot(overfit_tiny):
    cfg, run_dir, _, _ = overfit_tiny
    rows = read_jsonl(run_dir / "train/metrics.jsonl")
    taus = {r["step"]: r["tau"] for r in rows if "tau" in r}
    assert sorted(taus) == [45, 90] and rows[-1]["step"] == 90
    assert all(1.0 <= t <= cfg.eval.draft_steps + 1 for t in taus.values())
    history = list((run_dir / "train/wandb").glob("offline-run-*/run-*.wandb"))
    assert history and b"tau" in history[0].read_bytes()
    height, width = matplotlib.image.imread(run_dir / "train/curves.png").shape[:2]
    assert width > 3.5 * height  # three panels (loss, accuracy, τ), not two (2.8)


def test_tau_probe_equals_evals_engine_on_the_exported_drafter(overfit_tiny):
    """On the prompts the drafter memorised (τ far above 1), the probe's τ equals eval's hf engine's on the
    exported drafter, exactly. The probe folds a training-time aux_scale like the export does: scale fc's
    input by s and its weight by s (the same function), and τ must not move. The last logged τ (held-out
    prompts) is the probe's τ of the exported drafter."""
    cfg, run_dir, _, prompts = overfit_tiny
    info = target_info(cfg)
    drafter = Eagle3Drafter.from_pretrained(run_dir / "drafter", load_target_embeddings(cfg).embed, info.model_type,
                                            info.num_layers)
    scale = torch.rand(drafter.aux_scale.shape, generator=torch.Generator().manual_seed(0)) * 4 + 0.5
    with torch.no_grad():
        drafter.aux_scale.copy_(scale)
        drafter.fc.weight.mul_(scale)
    own = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, prompts=str(prompts), max_prompts=cfg.train.tau_prompts,
                                                            max_new_tokens=cfg.train.tau_new_tokens))
    tau = TauProbe(own)(drafter)
    summary, _ = hf_eval(own, eval_prompt_ids(own, load_tokenizer(own)), run_dir / "drafter")
    assert tau == summary["acceptance_length"] and tau > 1.5, (tau, summary["acceptance_length"])
    final = read_jsonl(run_dir / "train/metrics.jsonl")[-1]
    assert final["tau"] == TauProbe(cfg)(drafter)


def test_teacher_forced_accuracy_of_the_exported_drafter_agrees_with_training(overfit_tiny, tmp_path):
    """train/drafter_accuracy.py scores the drafter as an engine loads it: on the samples it memorised, its
    acc_k are those training logged at the end (the exported bf16 weights vs the training ones, last window);
    the same drafter with fc and its layer re-initialised scores far below, so the figure is the drafter's."""
    from train import drafter_accuracy as script

    cfg, run_dir, _, _ = overfit_tiny
    steps = cfg.train.ttt_steps
    r = script.teacher_forced_accuracy(cfg, run_dir / "drafter", steps)
    final = read_jsonl(run_dir / "train/metrics.jsonl")[-1]
    assert r["rows"][0] > 100 and len(r["acc"]) == steps
    for k in range(steps):
        assert abs(r["acc"][k] - final[f"acc_{k}"]) < 0.05, (k, r["acc"], final)
    assert r["acc"][0] > 0.5 and 1 < r["implied_tau"] <= steps + 1
    info = target_info(cfg)
    drafter = Eagle3Drafter.from_pretrained(run_dir / "drafter", load_target_embeddings(cfg).embed, info.model_type,
                                            info.num_layers)
    torch.manual_seed(0)
    for p in [*drafter.fc.parameters(), *drafter.midlayer.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    drafter.save_pretrained(tmp_path / "untrained")
    assert script.teacher_forced_accuracy(cfg, tmp_path / "untrained", steps)["acc"][0] < r["acc"][0] - 0.5
    # features of other aux layers would score garbage with exit 0: refused, naming the shards' manifest
    shutil.copytree(run_dir / "hidden", tmp_path / "other/hidden")
    manifest = tmp_path / "other/hidden/manifest.json"
    m = json.loads(manifest.read_text())
    m["compat"]["aux_layers"] = [0, 1, 2]
    manifest.write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"other/hidden/manifest.json: aux_layers = \[0, 1, 2\] but this run expects"):
        script.teacher_forced_accuracy(dataclasses.replace(cfg, run_dir=str(tmp_path / "other")), run_dir / "drafter",
                                       steps)


def test_prompts_heldout_means_the_held_out_prompts_whatever_eval_prompts_names(tiny_cfg):
    """`--prompts heldout` (eval, the llama.cpp scripts) is the held-out ShareGPT set, as eval.prompts=heldout is,
    also where eval.prompts names a file; a file given instead is read as before."""
    tok = load_tokenizer(tiny_cfg)
    mt_bench = str(ROOT / "tests/data/mt_bench_3.jsonl")
    tiny_cfg.eval.prompts = mt_bench
    from_file, held = eval_prompt_ids(tiny_cfg, tok), eval_prompt_ids(tiny_cfg, tok, "heldout")
    tiny_cfg.eval.prompts = "heldout"
    assert held and held == eval_prompt_ids(tiny_cfg, tok) and held != from_file
    assert eval_prompt_ids(tiny_cfg, tok, mt_bench) == from_file
