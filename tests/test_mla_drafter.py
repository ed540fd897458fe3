"""The MLA draft layer (train.draft_attention=mla) against SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM.

The reference forward is SGLang's own: the real `Eagle3MLAModel.forward` and `Eagle3MLADecoderLayer.forward` bodies
compiled from the installed source, run on the weights the real `load_weights` loaded from our export, with
transformers' DeepseekV3Attention (someone else's MLA, its q/kv norms at SGLang's eps) as the attention SGLang
computes and transformers' DeepseekV3MLP as its MLP. Our drafter, reloaded from the same export, must give the same
logits input and the same state for the next draft step; TTT == decode for MLA is test_draft_alignment.py's.
"""

import dataclasses
import functools
import json
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from core.drafters.drafter import DraftCache, DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import MLAShape
from core.run.errors import UserError
from tests.sglang_source import (
    MLA_FILE,
    _compile_method,
    check_mla_drafter,
    run_sglang_mla_load_weights,
    sglang_mla_config,
    sglang_mla_flags,
    sglang_mla_rope,
)
from train.draft_vocab import build_draft_vocab, d2t_offsets

H, V, VD, T = 48, 120, 60, 14
MLA = MLAShape(q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def make_mla_drafter(seed=0, **flags) -> Eagle3Drafter:
    """A small MLA drafter on random O(1)-output weights, norms far from 1 (a swapped norm shows)."""
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, head_dim=12,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layers=[3, 31, 59],
                      target_model_type="kimi_k2", rope_theta=50000.0, mla=MLA, **flags)
    d = Eagle3Drafter(c)
    draft_ids, t2d, _ = build_draft_vocab(torch.arange(V, 0, -1), VD)
    with torch.no_grad():
        d.d2t.copy_(d2t_offsets(draft_ids))
        d.t2d.copy_(t2d)
        for name, p in d.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
            elif "norm" in name:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
        d.embed_tokens.weight.normal_()
    return d


class _AddNorm(torch.nn.Module):
    """SGLang's RMSNorm: norm(x), or with a residual the fused norm(x + residual) and the sum."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight.float(), eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return out if residual is None else (out, residual)


def sglang_reference(export_dir, embed: torch.Tensor):
    """-> forward(input_ids [T], positions [T], aux [T,3H]) -> (hidden_states_to_logits, aux for the next step), as
    SGLang 0.5.23 runs the drafter exported to `export_dir` (its loader, its forward bodies, transformers' MLA)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3MLP,
        DeepseekV3RotaryEmbedding,
    )

    config = json.loads((export_dir / "config.json").read_text())
    c = sglang_mla_config(config)
    loaded = run_sglang_mla_load_weights(load_file(str(export_dir / "model.safetensors")), config)["params"]

    def weight(name, shard=None):
        return loaded[name].loaded[shard].float()

    p, eps = "model.midlayer.", c.rms_norm_eps
    rope_theta, rope_scaling = sglang_mla_rope(config)
    assert rope_scaling is None
    flags = sglang_mla_flags(config)
    # transformers' MLA over the [2H] input; its o_proj writes H of 2H columns (the rest zero), its norms SGLang's eps
    attn_cfg = c.__class__.from_dict({**c.to_dict(), "hidden_size": 2 * c.hidden_size, "rope_interleave":
                                      flags["rope_interleave"], "rope_parameters": {"rope_type": "default",
                                                                                    "rope_theta": rope_theta}})
    attn_cfg._attn_implementation = "eager"
    hf_attn = DeepseekV3Attention(attn_cfg, layer_idx=0).eval()
    fused = weight(p + "self_attn.fused_qkv_a_proj_with_mqa.weight")  # SGLang's fusion: [q_a; kv_a]
    with torch.no_grad():
        hf_attn.q_a_proj.weight.copy_(fused[:c.q_lora_rank])
        hf_attn.kv_a_proj_with_mqa.weight.copy_(fused[c.q_lora_rank:])
        for name in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj"):
            getattr(hf_attn, name).weight.copy_(weight(f"{p}self_attn.{name}.weight"))
        o = weight(p + "self_attn.o_proj.weight")
        hf_attn.o_proj.weight.copy_(torch.cat([o, torch.zeros_like(o)]))
    hf_attn.q_a_layernorm.variance_epsilon = hf_attn.kv_a_layernorm.variance_epsilon = eps
    rotary = DeepseekV3RotaryEmbedding(attn_cfg)

    class SelfAttn:  # SGLang's MLA call, computed by transformers' (its a-projections read the [2H] input too)
        prepare_qkv_latent = None  # published to SGLang's TP context, which this stand-in has no use for

        def __call__(self, positions, hidden_states, forward_batch, zero_allocator):
            x, t = hidden_states[None], hidden_states.shape[0]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            out, _ = hf_attn(x, rotary(x, positions[None]), mask)
            return out[0, :, :c.hidden_size]

    mlp = DeepseekV3MLP(c)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(weight(p + "mlp.gate_up_proj.weight", 0))
        mlp.up_proj.weight.copy_(weight(p + "mlp.gate_up_proj.weight", 1))
        mlp.down_proj.weight.copy_(weight(p + "mlp.down_proj.weight"))
    layer = types.SimpleNamespace(self_attn=SelfAttn(), mlp=mlp, **{
        n: _AddNorm(weight(f"{p}{n}.weight"), eps) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")})
    tp_context = types.SimpleNamespace(set_attn_inputs=lambda inputs: None)
    layer_forward = _compile_method(MLA_FILE, "Eagle3MLADecoderLayer", "forward", {
        "torch": torch, "get_attn_tp_context": lambda: tp_context, "AttentionInputs": lambda *a: None})
    fc_norm = [_AddNorm(weight(f"model.fc_norm.{i}.weight"), eps) for i in range(3)] if flags["fc_norm"] else None
    model = types.SimpleNamespace(
        embed_tokens=lambda ids: F.embedding(ids, embed), fc_norm=fc_norm, num_aux_hidden_states=3,
        fc=lambda x: (F.linear(x, weight("model.fc.weight")), None), _fc_gatherer=lambda x: x,
        midlayer=functools.partial(layer_forward, layer), norm=_AddNorm(weight("model.norm.weight"), eps),
        norm_output=flags["norm_output"])
    model_forward = _compile_method(MLA_FILE, "Eagle3MLAModel", "forward", {
        "torch": torch, "BumpAllocator": lambda **kw: None})

    def forward(input_ids, positions, aux):
        mode = types.SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
        batch = types.SimpleNamespace(mm_input_embeds=None, forward_mode=mode, contains_mm_inputs=lambda: False,
                                      spec_info=types.SimpleNamespace(hidden_states=aux))
        with torch.no_grad():
            logits_in, (next_aux,) = model_forward(model, input_ids, positions, batch)
        return logits_in, next_aux
    return forward


@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}], ids=["mla", "mla-eagle3.1"])
def test_our_mla_drafter_computes_what_sglang_serves(tmp_path, flags):
    """Export -> SGLang's real loader and forward bodies (transformers' MLA as its attention) give the hidden state
    the draft lm_head reads and the state the next draft step reads; ours, reloaded from the same export, equal."""
    d = make_mla_drafter(**flags)
    d.save_pretrained(tmp_path)
    ours = Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "kimi_k2", 61).eval()
    reference = sglang_reference(tmp_path, d.embed_tokens.weight.data)
    g = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V, (T,), generator=g), torch.randn(T, 3 * H, generator=g) * 4
    positions = torch.arange(T) + 5
    logits_in, next_aux = reference(ids, positions, aux)
    with torch.no_grad():
        logits, hidden = ours(aux[None], ids[None], positions[None], DraftCache(T))
    torch.testing.assert_close(logits[0], ours.lm_head(logits_in), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[0], next_aux, rtol=1e-4, atol=1e-4)


def test_mla_export_loads_every_tensor_by_sglang_names_and_shapes(tmp_path):
    """Every tensor of the export loads into a parameter of the shape SGLang builds (sizes from the real constructor
    calls), none is dropped, none of its parameters stays random, kv_b_proj splits into the absorbed w_kc / w_vc."""
    d = make_mla_drafter(fc_norm=True)
    d.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert sglang_mla_flags(config) == {"fc_norm": True, "norm_output": False, "rope_interleave": True}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert check_mla_drafter(tensors, config) == []
    result = run_sglang_mla_load_weights(tensors, config)
    assert result["w_kc"].shape == (4, MLA.qk_nope_head_dim, MLA.kv_lora_rank)
    assert result["w_vc"].shape == (4, MLA.kv_lora_rank, MLA.v_head_dim)
    # it can fail: a missing tensor, a dropped name, another shape
    fewer = {k: v for k, v in tensors.items() if "kv_b_proj" not in k}
    assert any("kv_b_proj" in p and "never loaded" in p for p in check_mla_drafter(fewer, config))
    renamed = {k.replace("q_b_proj", "q_proj"): v for k, v in tensors.items()}
    assert any("q_proj" in p and "ignored" in p for p in check_mla_drafter(renamed, config))
    assert any("SGLang builds" in p for p in check_mla_drafter(tensors, {**config, "kv_lora_rank": 32}))


def test_mla_config_round_trips_and_refuses_what_sglang_would_serve_otherwise(tmp_path):
    d = make_mla_drafter(norm_output=True)
    d.save_pretrained(tmp_path)
    back = Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "kimi_k2", 61)
    assert back.config.mla == MLA and back.config.norm_output and back.config.aux_layers == [3, 31, 59]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    with pytest.raises(UserError, match="rope_interleave = false"):
        Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "kimi_k2", 61)
    with pytest.raises(UserError, match="norm_before_fc with an MLA draft layer"):
        dataclasses.replace(d.config, norm_before_fc=True)


def test_mla_shape_defaults_from_the_target():
    """An MLA target's own sizes; a GQA target's head dim in DeepSeek-V3's proportions; a set size wins."""
    kimi = {"hidden_size": 7168, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert MLAShape.for_target(kimi, {}) == MLAShape(1536, 512, 128, 64, 128)
    smol = {"hidden_size": 576, "num_attention_heads": 9}
    assert MLAShape.for_target(smol, {}) == MLAShape(576, 256, 64, 32, 64)
    assert MLAShape.for_target(smol, {"kv_lora_rank": 128}).kv_lora_rank == 128
    with pytest.raises(UserError, match="must be even"):
        MLAShape.for_target(smol, {"qk_rope_head_dim": 31})


def test_llamacpp_export_refuses_an_mla_drafter_in_one_line(tmp_path):
    """llama.cpp b11434's converter takes LlamaForCausalLMEagle3 only: an MLA drafter is refused before it runs."""
    from eval.llamacpp import convert_drafter

    make_mla_drafter().save_pretrained(tmp_path / "d")
    with pytest.raises(UserError, match="llama.cpp b11434's converter takes LlamaForCausalLMEagle3 drafters only"):
        convert_drafter(tmp_path / "no-tree", tmp_path / "d", tmp_path / "no-target", tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()
