"""Kimi-K2.5 in miniature, end to end through the four CLIs with configs/kimi-k2.5.yaml itself (aux layers 3/31/59,
trust_remote_code, thinking rendered into the trained text), on tests/tiny_kimi.py's target: the released
checkpoint's layout (multimodal wrapper, `language_model.` weight names, 61 DeepSeek-V3 layers with MLA and MoE,
a remote-code tokenizer, Kimi's chat template with thinking) at toy widths. Only the sizes are overridden."""

import json
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from core.run.config import load_config
from core.storage.conversations import part_files
from core.storage.hidden_shards import HiddenShards, teacher_positions
from core.target.model import SMOLLM2, load_target, load_tokenizer, resolve_target
from extract.sglang_launch import launch_vars
from tests.conftest import ROOT, run_stage
from tests.fake_openai_server import FakeOpenAIServer
from tests.fake_vllm_server import FakeVLLMServer
from tests.sglang_source import (
    check_drafter_shapes,
    check_drafter_tensor_names,
    check_mla_drafter,
    sglang_capture_layers,
)
from tests.tiny_kimi import build_tiny_kimi

KIMI = "configs/kimi-k2.5.yaml"
SIZES = ["target.dtype=fp32", "target.device=cpu", "data_gen.backend=hf", "data_gen.num_samples=8",
         "data_gen.max_new_tokens=24", "data_gen.max_prompt_tokens=256", "data_gen.max_context_tokens=512",
         "data_gen.max_turns=1", "data_gen.batch_size=4", "data_gen.part_samples=4", "extract.engine=hf",
         "extract.dtype=bf16", "extract.shard_mb=1", "train.epochs=1", "train.ttt_steps=2",
         "train.draft_vocab_size=256", "train.batch_size=2", "train.max_len=512", "eval.engine=hf",
         "eval.max_prompts=2", "eval.max_new_tokens=8"]
THINKING = "First I weigh the question, then I answer it."


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    smollm2 = resolve_target(load_config(overrides=[f"target.model={SMOLLM2}"]))
    return build_tiny_kimi(root / "Kimi-K2.5-tiny", smollm2, root / "text-reference"), root / "text-reference"


def flags(model, run_dir, *extra):
    return ["--config", KIMI, "--run-dir", str(run_dir), f"target.model={model}", *SIZES, *extra]


@pytest.fixture(scope="module")
def chain(kimi, tmp_path_factory):
    model, _ = kimi
    run_dir = tmp_path_factory.mktemp("kimi-run") / "run"
    for stage in ("data_gen", "extract", "train", "eval"):
        run_stage(stage, *flags(model, run_dir))
    return load_config(ROOT / KIMI, [f"run_dir={run_dir}", f"target.model={model}", *SIZES]), run_dir


def rows(run_dir):
    return [r for f in part_files(run_dir / "conversations") for r in pq.read_table(f).to_pylist()]


def test_the_config_is_kimis(chain):
    cfg, _ = chain
    assert cfg.target.trust_remote_code and cfg.data_gen.reasoning == "render"
    assert cfg.extract.aux_layers == [3, 31, 59]
    assert launch_vars(cfg)[0]["REMOTE_CODE"] == "--trust-remote-code"


def test_a_remote_code_tokenizer_without_trust_remote_code_is_one_line(kimi, tmp_path):
    model, _ = kimi
    proc = run_stage("data_gen", *flags(model, tmp_path / "run", "target.trust_remote_code=false"), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "set target.trust_remote_code=true" in proc.stderr.strip().splitlines()[-1]


def assert_thinking_is_trained_on(tok, row, thinking: str | None = None):
    """The prompt ends in the template's open <think>; the trained span is what the model wrote: its
    reasoning, the close, the answer and <|im_end|> (only the reasoning when cut off while thinking)."""
    ids, mask = row["input_ids"], row["loss_mask"]
    first, last = mask.index(1), len(mask) - mask[::-1].index(1)
    assert all(mask[first:last]) and not any(mask[:first]) and not any(mask[last:])
    msg = row["messages"][-1]
    assert msg["reasoning_content"] and (thinking is None or msg["reasoning_content"] == thinking)
    assert tok.decode(ids[:first]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    span = tok.decode(ids[first:last])
    if row["finish_reason"] == "stop":
        assert span == msg["reasoning_content"] + "</think>" + msg["content"] + "<|im_end|>"
    else:
        assert span == (msg["reasoning_content"] + "</think>" + msg["content"] if msg["content"]
                        else msg["reasoning_content"])


def test_thinking_is_rendered_into_the_trained_text_in_process(chain):
    cfg, run_dir = chain
    tok = load_tokenizer(cfg)
    got = rows(run_dir)
    assert len(got) == 8
    for row in got:  # a random model never closes its thinking: every answer is reasoning cut at the cap
        assert_thinking_is_trained_on(tok, row)


def test_thinking_from_an_openai_server_is_rendered_into_the_trained_text(kimi, tmp_path):
    model, _ = kimi
    with FakeOpenAIServer(reasoning=THINKING) as server:  # TEST DOUBLE (tests/fake_openai_server.py)
        run_stage("data_gen", *flags(model, tmp_path / "run", "data_gen.backend=openai",
                                     f"data_gen.base_url={server.url}/v1", "data_gen.num_samples=4"))
    cfg = load_config(ROOT / KIMI, [f"target.model={model}"])
    got = rows(tmp_path / "run")
    assert len(got) == 4
    for row in got:
        assert_thinking_is_trained_on(load_tokenizer(cfg), row, THINKING)


def test_aux_layers_3_31_59_are_the_reference_forwards_hidden_states(chain, kimi):
    """Golden: the shards' aux rows are hidden_states[3], [31], [59] (and final the last) of the language model as
    transformers loads the plain DeepSeek-V3 reference checkpoint, which none of our loading code touched."""
    from transformers import AutoModelForCausalLM

    _, run_dir = chain
    ref = AutoModelForCausalLM.from_pretrained(kimi[1], dtype=torch.float32).eval()
    shards = HiddenShards(run_dir / "hidden")
    assert json.loads((run_dir / "hidden/manifest.json").read_text())["compat"]["aux_layers"] == [3, 31, 59]
    h = ref.config.hidden_size
    for sid in shards.ids[:3]:
        s = shards.load(sid)
        with torch.no_grad():
            hs = ref(s["input_ids"].long()[None], output_hidden_states=True).hidden_states
        assert len(hs) == 62
        aux = s["aux"].float()
        for j, i in enumerate([3, 31, 59]):  # bf16 storage: 1% of the values' scale; a neighbour layer is far off
            torch.testing.assert_close(aux[:, j * h:(j + 1) * h], hs[i][0], rtol=2e-2, atol=2e-2)
            assert (aux[:, j * h:(j + 1) * h] - hs[i + 1][0]).abs().max() > 0.1
        need = teacher_positions(s["loss_mask"])  # extract.spans=loss: final rows only where a teacher is read
        assert need.any()
        torch.testing.assert_close(s["final"].float()[need], hs[-1][0][need], rtol=2e-2, atol=2e-2)


def test_the_drafter_loads_in_sglang_by_name_and_shape_and_captures_3_31_59(chain):
    _, run_dir = chain
    config = json.loads((run_dir / "drafter/config.json").read_text())
    tensors = load_file(str(run_dir / "drafter/model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["vocab_size"] == 49216
    assert check_drafter_tensor_names(tensors) == []
    assert check_drafter_shapes(tensors, config) == []
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers("deepseek_v2.py", ids, 61) == [3, 31, 59]


def test_our_engine_decodes_kimi_losslessly(chain):
    _, run_dir = chain
    report = json.loads((run_dir / "eval/report.json").read_text())
    assert report["outputs_match_baseline"] is True and report["num_prompts"] == 2
    assert report["acceptance_length"] >= 1.0


def test_stock_vllm_extraction_writes_the_hf_engines_shards_bit_for_bit(chain, kimi, tmp_path):
    """extract.engine=vllm on Kimi's own config: the launcher asks vLLM for layers 3/31/59 and 61 (the last layer's
    output), and the shards through tests/fake_vllm_server.py (vLLM's connector code over the tiny Kimi) equal the
    hf engine's in fp32, bit for bit."""
    model, _ = kimi
    exact = ["extract.dtype=fp32", "extract.mixed_precision=fp32", "extract.batch_tokens=1"]
    for engine in ("hf", "vllm"):
        shutil.copytree(chain[1] / "conversations", tmp_path / engine / "conversations")
    run_stage("extract", *flags(model, tmp_path / "hf", *exact))
    launch = subprocess.run([sys.executable, "-m", "extract.vllm_launch", *flags(model, tmp_path / "vllm", *exact)],
                            cwd=ROOT, capture_output=True, text=True)
    assert launch.returncode == 0 and '"eagle_aux_hidden_state_layer_ids": [3, 31, 59, 61]' in launch.stdout
    assert " --trust-remote-code " in launch.stdout
    target, _ = load_target(load_config(ROOT / KIMI, [f"target.model={model}", *SIZES]))
    with FakeVLLMServer(target, launch.stdout.strip()) as server:
        run_stage("extract", *flags(model, tmp_path / "vllm", *exact, "extract.engine=vllm",
                                    f"extract.server_url={server.url}"))
    ours, ref = HiddenShards(tmp_path / "vllm/hidden"), HiddenShards(tmp_path / "hf/hidden")
    assert sorted(ours.ids) == sorted(ref.ids) and len(ref) == len(rows(chain[1]))
    for sid in ref.ids:
        a, b = ours.load(sid), ref.load(sid)
        for key in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(a[key], b[key]), (sid, key)


@pytest.fixture(scope="module")
def mla_chain(chain, kimi, tmp_path_factory):
    """train + eval of an MLA drafter (train.draft_attention=mla, sizes from the target) on the chain's shards."""
    model, _ = kimi
    run_dir = tmp_path_factory.mktemp("kimi-mla") / "run"
    for stage in ("conversations", "hidden"):
        shutil.copytree(chain[1] / stage, run_dir / stage)
    for stage in ("train", "eval"):
        run_stage(stage, *flags(model, run_dir, "train.draft_attention=mla"))
    return run_dir


def test_the_mla_drafter_loads_in_sglangs_mla_class_and_decodes_losslessly(mla_chain):
    """Kimi's MLA draft layer: the target's own MLA sizes, every tensor loaded by SGLang 0.5.23's
    Eagle3DeepseekV2ForCausalLM by name and shape, its aux ids capturing 3/31/59, our engine lossless with it."""
    config = json.loads((mla_chain / "drafter/config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert [config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                "v_head_dim")] == [16, 16, 8, 8, 8]
    assert check_mla_drafter(load_file(str(mla_chain / "drafter/model.safetensors")), config) == []
    assert sglang_capture_layers("deepseek_v2.py", config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                                 61) == [3, 31, 59]
    report = json.loads((mla_chain / "eval/report.json").read_text())
    assert report["outputs_match_baseline"] is True and report["num_prompts"] == 2
