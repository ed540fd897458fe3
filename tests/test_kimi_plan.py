"""What a Kimi-K2.5 run costs, from its config alone: the target's parameters (arithmetic checked against
transformers' own modules built on the meta device), shard disk beside the user's hand-patched dump, the
memory refusal of train.source=online, and a plan warning when train.max_len would cut samples."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.run.config import load_config
from core.run.plan import format_plan
from core.target.model import check_target_fits, read_target_config, resolve_target, text_model_config
from core.target.size import target_params
from tests.conftest import ROOT, run_stage


@pytest.mark.parametrize("name", ["kimi-k2.5", "llama-3.1-8b-instruct", "qwen3-8b", "smollm2-135m-instruct"])
def test_target_parameters_are_the_modules(name):
    cfg = load_config(ROOT / f"configs/{name}.yaml")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_model_config(cfg))
    counted = sum(p.numel() for p in model.parameters()) + sum(  # DeepSeek-V3's router bias is a buffer
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert target_params(read_target_config(resolve_target(cfg))) == counted
    if name == "kimi-k2.5":
        assert 1.02e12 < counted < 1.03e12


def test_kimi_plan_prints_disk_memory_and_the_hand_patched_run(tmp_path):
    text = format_plan(load_config(ROOT / "configs/kimi-k2.5.yaml", [f"run_dir={tmp_path}"]), world_size=8)
    assert "1,026.41B parameters -> 1.9 TiB in bf16" in text
    # what the drafter costs a server in KV cache: 2 x 64 heads x 112 dims, or one MLA latent, beside the target's 61
    assert ("draft KV cache per token in bf16 (one layer; +% of the target's while drafting): gqa 28.0 KiB (GQA: 2 x "
            "64 x 112, +41%) <- this run, mla 1.1 KiB (MLA: 512 + 64, +2%); the target's 68.6 KiB (MLA: (512 + 64) x "
            "61 layers)") in text
    mla = format_plan(load_config(ROOT / "configs/kimi-k2.5.yaml", ["train.draft_attention=mla"]))
    assert "gqa 28.0 KiB (GQA: 2 x 64 x 112, +41%), mla 1.1 KiB (MLA: 512 + 64, +2%) <- this run" in mla
    assert "MLA 64 heads: q_lora 1536, kv_lora 512, qk 128+64, v 128" in mla
    assert "that run's dump took 924 GiB for 10,000 samples" in text
    # 1,730 tokens x (4 + 1 + 4 x 7168 x 2) B = 924 GiB: our bf16 layout is the hand-patched one, fp8 half
    assert "10,000 samples: fp8_e4m3 462 / 4,378, bf16 924 / 8,751" in text
    assert "100,000 samples: fp8_e4m3 4,623 / 43,782" in text
    assert "memory per GPU ~70.3 GiB" in text and "WARNING" not in text  # max_len covers the longest sample
    cut = format_plan(load_config(ROOT / "configs/kimi-k2.5.yaml", ["train.max_len=2048"]))
    assert "WARNING: train.max_len 2,048 < 16,384" in cut


def test_online_training_refuses_a_target_that_cannot_fit_in_one_line(tmp_path):
    proc = run_stage("train", "--config", "configs/kimi-k2.5.yaml", "--run-dir", str(tmp_path / "run"),
                     "train.source=online", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "1.9 TiB in bf16" in last and "1,026.4B parameters" in last and "train.source=offline" in last


def test_a_target_that_fits_passes_the_check():
    check_target_fits(load_config(ROOT / "configs/tiny-random-llama.yaml"), torch.device("cpu"))
