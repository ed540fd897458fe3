"""The shipped target configs (configs/<target>.yaml + configs/targets/<target>/config.json) validate offline,
give the drafter the target's shape, export the layer ids each engine needs, and plan (--dry-run) without
weights. SGLang's rule is executed from the real sglang==0.5.23 source, found by the config's architecture."""

import ast
import json

import pytest
import torch

from core.drafters.drafter import EXPORT_EXCLUDE, DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import MLAShape
from core.run.config import TrainKernels, check_ranges, load_config
from core.run.measured import THINKING, TRAIN_SPEED
from core.run.plan import drafter_params, plan, shard_bytes_per_token, train_memory
from core.target.aux_layers import resolve_aux_layers
from core.target.model import read_target_config, target_info
from extract.sglang_launch import launch_vars
from tests.conftest import ROOT, run_cli
from tests.sglang_source import (
    check_drafter_shapes,
    check_drafter_tensor_names,
    sglang_capture_layers,
    sglang_root,
    source_class,
)

# public config.json values: (model_type, layers, hidden, vocab, heads, kv heads, head_dim, MLP)
TARGETS = {
    "llama-3.1-8b-instruct": ("llama", 32, 4096, 128256, 32, 8, 128, 14336),
    "qwen3-8b": ("qwen3", 36, 4096, 151936, 32, 8, 128, 12288),
    "kimi-k2.5": ("kimi_k2", 61, 7168, 163840, 64, 64, 112, 18432),  # MLA: no head_dim, 7168 / 64
}
# input-of-layer aux ids, and what SGLang 0.5.23 must be given to capture them (golden)
AUX = {"llama-3.1-8b-instruct": ([2, 16, 29], [1, 15, 28]), "qwen3-8b": ([2, 18, 33], [1, 17, 32]),
       "kimi-k2.5": ([3, 31, 59], [3, 31, 59])}


def target_cfg(name: str, tmp_path, *overrides):
    return load_config(ROOT / f"configs/{name}.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("name", TARGETS)
def test_config_validates_offline_with_the_public_shape(name, tmp_path):
    cfg = check_ranges(target_cfg(name, tmp_path))
    info = target_info(cfg)  # config.json only: no weights, no tokenizer, no network
    model_type, layers, hidden, vocab = TARGETS[name][:4]
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == (model_type, layers, hidden, vocab)
    assert resolve_aux_layers(cfg.extract.aux_layers, layers) == AUX[name][0]


def test_a_config_without_weights_is_refused_before_loading(tmp_path):
    from core.target.model import load_target

    with pytest.raises(ValueError, match="no \\*.safetensors weights.*target.model="):
        load_target(target_cfg("qwen3-8b", tmp_path, "target.device=cpu"))


@pytest.mark.parametrize("name", TARGETS)
def test_drafter_train_builds_has_the_target_shape(name, tmp_path):
    cfg = target_cfg(name, tmp_path)
    tc = read_target_config(target_info(cfg).path)
    _, layers, hidden, vocab, heads, kv, head_dim, mlp = TARGETS[name]
    dc = DrafterConfig.for_target(tc, AUX[name][0], cfg.train.draft_vocab_size)
    assert (dc.hidden_size, dc.target_hidden_size, dc.vocab_size, dc.draft_vocab_size) == (hidden, hidden, vocab, 32000)
    assert (dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, dc.intermediate_size) == (heads, kv, head_dim, mlp)
    assert dc.target_model_type == TARGETS[name][0]
    assert dc.rope_theta == {"llama": 500000.0, "qwen3": 1e6, "kimi_k2": 50000.0}[dc.target_model_type]


def test_a_config_head_dim_wins_over_hidden_by_heads():
    """Qwen3-0.6B's shape: 16 heads x 128 on a 1024-wide stream (not 1024 / 16 = 64)."""
    tc = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
          "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "num_hidden_layers": 28}
    assert DrafterConfig.for_target(tc, [2, 14, 25], 32000).head_dim == 128


def sglang_model_file(arch: str) -> str:
    """The SGLang model file that defines and registers `arch` (what the server loads for this config)."""
    files = [f for f in sorted((sglang_root() / "srt/models").glob("*.py"))
             if f"\nclass {arch}(" in (text := f.read_text()) and arch in text[text.rfind("EntryClass"):]]
    assert len(files) == 1, f"{arch}: expected one SGLang model file, found {files}"
    return files[0].name


def sglang_capture_file(config: dict) -> str:
    """File whose set_eagle3_layers_to_capture runs for this target. Kimi-K2.5's wrapper hands the ids
    to its language model, a DeepseekV3ForCausalLM: checked in its source, then followed."""
    name = sglang_model_file(config["architectures"][0])
    if name != "kimi_k25.py":
        return name
    cls = source_class(f"srt/models/{name}", config["architectures"][0])
    body = ast.unparse(cls)
    assert "self.language_model = DeepseekV3ForCausalLM(" in body
    method = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture")
    assert "self.language_model.set_eagle3_layers_to_capture(layer_ids)" in ast.unparse(method)
    return sglang_model_file("DeepseekV3ForCausalLM")


@pytest.mark.parametrize("name", TARGETS)
def test_export_gives_each_engine_the_trained_layers(name, tmp_path):
    """SGLang (its real rule, from the file this architecture loads) captures the trained layers from
    eagle_config; llama.cpp's converter reads the top-level key as input-of-layer ids; the SGLang
    extraction launcher passes the same ids. A shift by one on either side fails here."""
    cfg = target_cfg(name, tmp_path)
    config = json.loads((target_info(cfg).path / "config.json").read_text())
    aux, sglang_ids = AUX[name]
    export = DrafterConfig.for_target(read_target_config(target_info(cfg).path), aux, 32000).to_sglang()
    ids = export["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == sglang_ids
    layers = TARGETS[name][1]
    capture_file = sglang_capture_file(config)
    assert sglang_capture_layers(capture_file, ids, layers) == aux
    assert sglang_capture_layers(capture_file, [i + 1 for i in ids], layers) != aux
    assert export["eagle_aux_hidden_state_layer_ids"] == aux  # llama.cpp: conversion/llama.py reads it as is
    env, _ = launch_vars(cfg)
    assert env["LAYER_IDS"] == " ".join(map(str, sglang_ids))


@pytest.mark.parametrize("name", TARGETS)
def test_full_size_export_loads_in_sglang_with_every_shape(name, tmp_path):
    """The drafter a real run on this target exports (built on the meta device: shapes, no memory) loads in SGLang
    0.5.23's LlamaForCausalLMEagle3 by name and by shape: Kimi-K2.5's 7168-wide, 64-head drafter (head_dim 112,
    SGLang's hidden / heads since MLA has no head_dim) included."""
    cfg = target_cfg(name, tmp_path)
    dc = DrafterConfig.for_target(read_target_config(target_info(cfg).path), AUX[name][0], cfg.train.draft_vocab_size)
    with torch.device("meta"):
        tensors = {k: v for k, v in Eagle3Drafter(dc).state_dict().items() if k not in EXPORT_EXCLUDE}
    tensors.update(d2t=torch.zeros(dc.draft_vocab_size, dtype=torch.int64),  # the loader does arithmetic on it
                   t2d=torch.zeros(dc.vocab_size, dtype=torch.bool))
    assert check_drafter_tensor_names(tensors) == []
    assert check_drafter_shapes(tensors, dc.to_sglang()) == []
    assert check_drafter_shapes(tensors, {**dc.to_sglang(), "head_dim": dc.head_dim * 2}) != []  # it can fail


@pytest.mark.parametrize("dc", [
    DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=100, draft_vocab_size=50, target_hidden_size=64),
    DrafterConfig(hidden_size=56, intermediate_size=96, num_attention_heads=8, num_key_value_heads=8, head_dim=7,
                  vocab_size=90, draft_vocab_size=30, target_hidden_size=80),
    DrafterConfig(hidden_size=56, intermediate_size=96, num_attention_heads=8, num_key_value_heads=8, head_dim=7,
                  vocab_size=90, draft_vocab_size=30, target_hidden_size=80, norm_before_fc=True, fc_norm=True),
    DrafterConfig(hidden_size=56, intermediate_size=96, num_attention_heads=8, num_key_value_heads=8, head_dim=7,
                  vocab_size=90, draft_vocab_size=30, target_hidden_size=80, fc_norm=True,
                  mla=MLAShape(q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5))],
    ids=["gqa", "mha-other-target", "eagle3.1-norms", "mla"])
def test_planned_parameter_counts_are_the_drafters(dc):
    counts, d = drafter_params(dc), Eagle3Drafter(dc)
    assert sum(counts.values()) == sum(p.numel() for p in d.parameters())
    assert counts["embed_tokens"] == d.embed_tokens.weight.numel() and counts["lm_head"] == d.lm_head.weight.numel()


def test_shard_bytes_per_token_match_the_layout():
    assert shard_bytes_per_token(4096, "bf16") == 8 * 4096 + 5  # ids int32 + mask u8 + 4H bf16
    assert shard_bytes_per_token(7168, "fp8_e4m3") == 4 * 7168 + 5 + 16  # + 4 fp32 scales


@pytest.mark.parametrize("name", [*TARGETS, "tiny-random-llama"])
def test_plan_numbers(name, tmp_path):
    cfg = load_config(ROOT / f"configs/{name}.yaml", [f"run_dir={tmp_path / 'run'}"])
    p = plan(cfg, world_size=8)
    t = cfg.train
    steps = -(-cfg.data_gen.num_samples // (t.batch_size * 8 * t.grad_accum)) * t.epochs
    assert f"= {steps:,}" in plan_line(p, "train", "steps:")
    info = target_info(cfg)
    assert f"{shard_bytes_per_token(info.hidden_size, cfg.extract.dtype):,} B/token" in p["extract"][0]
    aux = resolve_aux_layers(cfg.extract.aux_layers, info.num_layers)
    assert f"llama.cpp top-level ids {aux}" in plan_line(p, "target", "aux layers")
    assert not (tmp_path / "run").exists()


def plan_line(p: dict, stage: str, start: str) -> str:
    return next(line for line in p[stage] if line.startswith(start))


def test_plan_times_only_measured_shapes(tmp_path):
    cfg = target_cfg("kimi-k2.5", tmp_path)
    kimi = plan(cfg, world_size=8)
    assert "not measured" in plan_line(kimi, "extract", "time:")
    # Kimi's drafter: hours from its measured tokens/s by length, summed over the stated lengths, 8 GPUs at 90%
    speed, lengths = TRAIN_SPEED[(7168, 61, "gqa")], THINKING.quantiles()
    assert speed.rate(3072) == (speed.tokens_per_s[2048] + speed.tokens_per_s[4096]) / 2
    assert speed.rate(100) == speed.tokens_per_s[2048] and speed.rate(10**6) == speed.tokens_per_s[max(speed.tokens_per_s)]
    seconds = 16000 * 10 * sum(n / speed.rate(n) for n in lengths) / len(lengths) / (8 * 0.9)
    took = f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.1f} min"
    assert plan_line(kimi, "train", "time:").startswith(f"time: ~{took} on 8 GPU(s) for 16,000 samples x 10")
    assert abs(sum(lengths) / len(lengths) - 1730) < 30  # the hand-patched run's mean, within the cut's effect
    llama = plan(target_cfg("llama-3.1-8b-instruct", tmp_path))
    tokens = 16000 * (4096 + 1024)
    assert f"~{tokens / 17_553 / 3600:,.1f} h at 17,553 tok/s" in plan_line(llama, "extract", "time:")


# peak GiB of one 8B-shaped step (no AdamW moments; per-step graphs, without / with activation checkpointing),
# one H200, bench/bench_train_step.py (docs/PERFORMANCE.md)
H200_PEAK_GIB = {2048: (11.49, 6.26), 4096: (15.24, 7.66), 8192: (22.25, 10.26), 16384: (36.26, 15.47)}


def test_train_memory_estimate_matches_the_h200_measurements_and_grows_with_batch_and_steps():
    dc = DrafterConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096)
    trainable = 424_689_664  # the bench's drafter
    for t, measured in H200_PEAK_GIB.items():
        for checkpointing, gib in zip((False, True), measured, strict=True):
            est = train_memory(dc, trainable, 1, t, 7, True, TrainKernels(activation_checkpointing=checkpointing))
            without_adam = (sum(est.values()) - 8 * trainable) / 2**30
            assert abs(without_adam - gib) / gib < 0.1, (t, checkpointing, without_adam, gib)
    base = train_memory(dc, 400_000_000, 2, 2048, 7, True)
    assert base["weights, grads, AdamW"] == 18 * 400_000_000  # fp32 x 4 + the bf16 autocast copies
    masters = train_memory(dc, 400_000_000, 2, 2048, 7, True, TrainKernels(bf16_weights=True))  # bf16 x 2 + fp32 masters x 3
    assert masters["weights, grads, AdamW"] == 16 * 400_000_000
    assert train_memory(dc, 400_000_000, 4, 2048, 7, True)["activations"] > base["activations"]
    assert train_memory(dc, 400_000_000, 2, 2048, 3, True)["activations"] < base["activations"]


def test_dry_run_cli_prints_the_stage_and_writes_nothing(tmp_path):
    proc = run_cli("train", "--config", "configs/kimi-k2.5.yaml", "--dry-run", "--world-size", "8",
                   "--run-dir", str(tmp_path / "run"))
    assert "train:" in proc.stdout and "extract:" not in proc.stdout
    assert "1,139.6M trainable" in proc.stdout and "ceil(16,000 / (1 batch x 8 processes x 1 accum))" in proc.stdout
    assert not (tmp_path / "run").exists()
