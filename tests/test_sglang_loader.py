"""Exported drafter names, hook targets and layer-id rules, checked against REAL SGLang 0.5.23.

The wheel is pip-installed once into a cache (see sglang_source.py); an install failure makes
these tests fail, never skip: a skipped check would let a misspelt tensor name reach serving,
where SGLang ignores it silently and the drafter runs with a random weight.
"""

from __future__ import annotations

import ast
import copy

import pytest
import torch

try:
    from tests import sglang_source as sgl
except ModuleNotFoundError:  # tests/ on sys.path instead of the repo root
    import sglang_source as sgl

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 8, 2, 1, 4, 16, 50, 10


@pytest.fixture(scope="module")
def sglang_pkg():
    """Install (or reuse) the real sglang package once; RuntimeError here fails every test."""
    return sgl.sglang_root()


def drafter_tensors(prefix: str = "") -> dict[str, torch.Tensor]:
    """A correct drafter export in the format reference's names (prefix "" or "model.")."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g)

    mid = prefix + "midlayer."
    d2t = torch.tensor([0, 1, 3, 5, 6, 10, 15, 21, 28, 39], dtype=torch.int64)  # target id - draft id
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[d2t + torch.arange(DRAFT_VOCAB)] = True
    return {
        prefix + "fc.weight": w(H, 3 * H),
        mid + "input_layernorm.weight": w(H),
        mid + "hidden_norm.weight": w(H),
        mid + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H),
        mid + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        mid + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        mid + "self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        mid + "post_attention_layernorm.weight": w(H),
        mid + "mlp.gate_proj.weight": w(INTER, H),
        mid + "mlp.up_proj.weight": w(INTER, H),
        mid + "mlp.down_proj.weight": w(H, INTER),
        prefix + "norm.weight": w(H),
        "lm_head.weight": w(DRAFT_VOCAB, H),  # a CausalLM's head sits beside `model.`, never inside
        "d2t": d2t,
        "t2d": t2d,
    }


# ----------------------------------------------------------------------------- tensor names
def test_param_names_are_found_in_source(sglang_pkg):
    names = sgl.sglang_eagle3_param_names()
    layer = "model.layers.0."
    assert names == {
        "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
        *(layer + s for s in ("input_layernorm.weight", "hidden_norm.weight",
                              "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                              "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")),
    }
    assert "model.layers.1.hidden_norm.weight" in sgl.sglang_eagle3_param_names(num_layers=2)


@pytest.mark.parametrize("prefix", ["", "model."])
def test_correct_export_loads_completely(sglang_pkg, prefix):
    tensors = drafter_tensors(prefix)
    assert sgl.check_drafter_tensor_names(tensors) == []
    result = sgl.run_sglang_load_weights(tensors)
    assert result["ignored"] == []
    assert sorted(result["loaded"]["model.layers.0.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert result["loaded"]["model.layers.0.mlp.gate_up_proj.weight"] == [0, 1]
    d2t = tensors["d2t"]
    assert torch.equal(result["hot_token_id"], d2t + torch.arange(DRAFT_VOCAB))
    shapes = {(src, shard): shape for src, _, shard, shape in result["calls"]}
    assert shapes[(prefix + "midlayer.self_attn.k_proj.weight", "k")] == (KV_HEADS * HEAD_DIM, 2 * H)


def test_misspelt_name_is_reported(sglang_pkg):
    tensors = drafter_tensors()
    tensors["midlayer.hiden_norm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    problems = sgl.check_drafter_tensor_names(tensors)
    assert any(p.startswith("midlayer.hiden_norm.weight: ignored") for p in problems), problems
    assert any(p.startswith("model.layers.0.hidden_norm.weight: never loaded") for p in problems), problems


@pytest.mark.parametrize("missing, expected", [
    ("norm.weight", "model.norm.weight: never loaded"),
    ("midlayer.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight: loaded with shards [0]"),
    ("midlayer.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight: loaded with shards"),
    ("d2t", "d2t missing"),
])
def test_missing_tensor_is_reported(sglang_pkg, missing, expected):
    tensors = drafter_tensors()
    del tensors[missing]
    problems = sgl.check_drafter_tensor_names(tensors)
    assert any(p.startswith(expected) for p in problems), problems


def test_prefixed_lm_head_and_duplicates_are_reported(sglang_pkg):
    # The loader tries `name` then `model.{name}`: `model.lm_head.weight` matches neither.
    tensors = drafter_tensors()
    tensors["model.lm_head.weight"] = tensors.pop("lm_head.weight")
    assert "model.lm_head.weight" in sgl.run_sglang_load_weights(tensors)["ignored"]
    assert any(p.startswith("lm_head.weight: never loaded") for p in sgl.check_drafter_tensor_names(tensors))
    # The same weight under both spellings loads twice (the last one silently wins).
    tensors = drafter_tensors()
    tensors["model.fc.weight"] = copy.deepcopy(tensors["fc.weight"])
    assert any(p.startswith("model.fc.weight: loaded with shards [None, None]")
               for p in sgl.check_drafter_tensor_names(tensors))


def test_embed_tokens_may_be_absent_or_present(sglang_pkg):
    tensors = drafter_tensors()
    tensors["embed_tokens.weight"] = torch.zeros(VOCAB, H)
    assert sgl.check_drafter_tensor_names(tensors) == []


# ----------------------------------------------------------------------------- hook targets
def _signature(fn: ast.FunctionDef) -> str:
    """`def` arguments as source text, annotations dropped."""
    args = copy.deepcopy(fn.args)
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    return ast.unparse(args)


@pytest.mark.parametrize("rel_path, cls, method, expected", [
    ("srt/managers/scheduler_components/batch_result_processor.py", "SchedulerBatchResultProcessor",
     "_append_prefill_hidden_states",
     "self, *, req, logits_output, hidden_state_offset, capture_hidden_mode, extend_input_len, store=True"),
    ("srt/managers/utils.py", "GenerationBatchResult", "copy_to_cpu",
     "self, return_logprob, return_hidden_states=True"),
])
def test_hook_target_signature(sglang_pkg, rel_path, cls, method, expected):
    assert _signature(sgl.source_method(rel_path, cls, method)) == expected


# ----------------------------------------------------------------------------- aux layer ids
@pytest.mark.parametrize("model_file, layer_ids, num_layers, captured", [
    ("llama.py", [1, 14, 26], 30, [2, 15, 27]),
    ("deepseek_v2.py", [3, 31, 59], 61, [3, 31, 59]),
    ("deepseek_v2.py", [1, 30, 58], 61, [2, 31, 59]),
    ("llama.py", None, 30, [2, 15, 27]),
    ("llama.py", None, 32, [2, 16, 29]),
    ("deepseek_v2.py", None, 61, [2, 30, 58]),
    ("deepseek_v2.py", None, 32, [2, 16, 29]),
])
def test_sglang_capture_layers(sglang_pkg, model_file, layer_ids, num_layers, captured):
    assert sgl.sglang_capture_layers(model_file, layer_ids, num_layers) == captured
