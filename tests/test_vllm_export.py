"""Our drafter as vLLM 0.33 serves it, checked against vLLM's and speculators 0.9's real source (tests/vllm_source.py):
both formats (drafter/: the HF format SGLang also reads; drafter-speculators/: what `vllm serve <dir>` reads alone)
reach vLLM's EAGLE-3 Llama draft class with the trained aux layer ids (both model runners), the norm flags and
the draft vocab; every tensor loads, none is left uninitialised; and vLLM's own draft forward, run on what its
loader loaded, gives our decode engine's logits and next-step state."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from core.drafters.drafter import DraftCache, DrafterConfig, Eagle3Drafter
from core.drafters.drafter_config import MLAShape, Verifier
from core.run.errors import UserError
from tests.vllm_source import (
    aux_layer_ids,
    build_vllm_eagle3,
    build_vllm_eagle3_mla,
    check_vllm_load,
    draft_hf_config,
    registry_entry,
    serve_alone,
    speculators_config_class,
    vllm_llama_capture,
)
from train.draft_vocab import build_draft_vocab, d2t_offsets

H, V, VD, LAYERS, K = 64, 120, 48, 8, 4
AUX = [2, 4, 5]
VARIANTS = {"plain": {}, "norm_before_fc": {"norm_before_fc": True},
            "fc_norm+norm_output": {"fc_norm": True, "norm_output": True}}
VERIFIER = Verifier("HuggingFaceTB/SmolLM2-135M-Instruct", ["LlamaForCausalLM"])


def make_drafter(**flags) -> Eagle3Drafter:
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, aux_layers=AUX,
                      target_model_type="llama", rope_theta=10000.0, **flags)
    d = Eagle3Drafter(c)
    for p in d.parameters():  # norms away from 1, so a dropped norm weight changes the output
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.1)
    draft_ids, t2d, _ = build_draft_vocab(torch.arange(V, 0, -1), VD)
    d.d2t.copy_(d2t_offsets(draft_ids))
    d.t2d.copy_(t2d)
    d.aux_scale.copy_(torch.rand(3 * H) + 0.5)  # folded into fc by the export
    return d


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """(variant flags, the drafter's embedding, SGLang-format dir, speculators-format dir)."""
    drafter = make_drafter(**VARIANTS[request.param])
    root = tmp_path_factory.mktemp(request.param)
    drafter.save_pretrained(root / "drafter")
    drafter.save_speculators(root / "drafter-speculators", VERIFIER, K, root / "drafter" / "model.safetensors")
    return VARIANTS[request.param], drafter.embed_tokens.weight.detach(), root / "drafter", root / "drafter-speculators"


def vllm_model(drafter_dir, embed):
    """vLLM's draft model for drafter_dir, its weights loaded by its real load_weights (problems asserted empty),
    the target's embedding shared as vLLM shares it."""
    model, record = build_vllm_eagle3(draft_hf_config(drafter_dir), V, LAYERS)
    assert check_vllm_load(model, record, load_file(str(drafter_dir / "model.safetensors"))) == []
    model.model.embed_tokens.weight.data.copy_(embed)
    return model


@pytest.mark.parametrize("fmt", ["drafter", "drafter-speculators"])
def test_vllm_reads_the_trained_layer_ids_flags_and_draft_vocab(exported, fmt):
    flags, _, sglang_dir, speculators_dir = exported
    hf = draft_hf_config(sglang_dir if fmt == "drafter" else speculators_dir)
    assert registry_entry(hf.architectures[0]) == ("llama_eagle3", "Eagle3LlamaForCausalLM")
    assert aux_layer_ids(hf) == {"v2": tuple(AUX), "v1": tuple(AUX)}  # input-of-layer ids: vLLM's own convention
    assert hf.draft_vocab_size == VD and hf.vocab_size == V
    assert not getattr(hf, "norm_before_residual", False)  # speculators: absent means true, another layer
    model, _ = build_vllm_eagle3(hf, V, LAYERS)
    built = {"norm_before_fc": model.model.norm_before_fc, "fc_norm": model.model.fc_norm is not None,
             "norm_output": bool(model.model.norm_output)}
    assert built == {f: flags.get(f, False) for f in built}


@pytest.mark.parametrize("fmt", ["drafter", "drafter-speculators"])
def test_vllm_draft_forward_on_its_loaded_weights_equals_our_engine(exported, fmt):
    """Two draft steps of vLLM's Eagle3LlamaForCausalLM (combine_hidden_states, forward, compute_logits, the next
    step reading its aux output) against our decode engine on the same export: same logits over the target vocab."""
    _, embed, sglang_dir, speculators_dir = exported
    model = vllm_model(sglang_dir if fmt == "drafter" else speculators_dir, embed)
    ours = Eagle3Drafter.from_pretrained(sglang_dir if fmt == "drafter" else speculators_dir, embed, "llama", LAYERS)
    g = torch.Generator().manual_seed(3)
    t = 9
    aux, tokens = torch.randn(t, 3 * H, generator=g) * 4, torch.randint(0, V, (t,), generator=g)
    positions = torch.arange(t)
    cache = DraftCache(2 * t)
    with torch.no_grad():
        hidden, d_next = model.combine_hidden_states(aux), aux[None]
        for step in range(2):
            out, hidden = model(tokens, positions + step * t, hidden)
            logits = model.compute_logits(out)
            d_logits, d_next = ours(d_next, tokens[None], (positions + step * t)[None], cache)
            full = torch.full((t, V), float("-inf"))
            full[:, ours.draft_to_target(torch.arange(VD))] = d_logits[0]
            torch.testing.assert_close(logits, full, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(hidden, d_next[0], atol=2e-4, rtol=2e-4)


def test_vllm_serve_alone_starts_the_verifier_with_the_drafter(exported):
    _, _, _, speculators_dir = exported
    assert serve_alone(speculators_dir) == (VERIFIER.name_or_path, {
        "method": "eagle3", "num_speculative_tokens": K, "model": str(speculators_dir)})


def test_speculators_own_config_class_parses_our_config(exported):
    flags, _, _, speculators_dir = exported
    raw = json.loads((speculators_dir / "config.json").read_text())
    c = speculators_config_class().model_validate(raw)
    assert (c.speculators_model_type, c.draft_vocab_size, c.target_hidden_size) == ("eagle3", VD, H)
    assert c.eagle_aux_hidden_state_layer_ids == AUX and c.norm_before_residual is False
    assert {f: getattr(c, f) for f in ("norm_before_fc", "fc_norm", "norm_output")} == {
        f: flags.get(f, False) for f in ("norm_before_fc", "fc_norm", "norm_output")}
    assert c.speculators_config.proposal_methods[0].speculative_tokens == K
    assert c.speculators_config.verifier.name_or_path == VERIFIER.name_or_path
    assert c.transformer_layer_config.hidden_size == H and c.transformer_layer_config.num_key_value_heads == 2


def test_our_loader_reads_the_speculators_dir_as_the_same_drafter(exported):
    _, embed, sglang_dir, speculators_dir = exported
    a = Eagle3Drafter.from_pretrained(sglang_dir, embed, "llama", LAYERS)
    b = Eagle3Drafter.from_pretrained(speculators_dir, embed, "llama", LAYERS)
    assert a.config == b.config
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_a_speculators_config_we_cannot_serve_as_trained_is_refused():
    raw = make_drafter().config.to_speculators(VERIFIER, K)
    del raw["norm_before_residual"]  # vLLM reads absent as true: a layer our drafter is not
    with pytest.raises(UserError, match="norm_before_residual"):
        DrafterConfig.from_speculators(raw, "llama")
    raw = make_drafter().config.to_speculators(VERIFIER, K)
    del raw["eagle_aux_hidden_state_layer_ids"]  # vLLM would capture its default layers
    with pytest.raises(UserError, match="eagle_aux_hidden_state_layer_ids"):
        DrafterConfig.from_speculators(raw, "llama")


def test_no_speculators_config_for_what_the_format_cannot_hold():
    base = make_drafter().config
    mla = DrafterConfig(**{**base.__dict__, "mla": MLAShape(32, 32, 16, 8, 16)})
    with pytest.raises(UserError, match="MLA"):
        mla.to_speculators(VERIFIER, K)
    both = DrafterConfig(**{**base.__dict__, "norm_before_fc": True, "fc_norm": True})
    with pytest.raises(UserError, match="norm_before_fc with fc_norm"):
        both.to_speculators(VERIFIER, K)


@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True}], ids=["plain", "eagle3.1"])
def test_an_mla_drafter_loads_whole_in_vllms_deepseek_eagle3_class(tmp_path, flags):
    """An MLA drafter for a Kimi-K2.5-style target (drafter/ only: no speculators form): vLLM's registry sends it
    to Eagle3DeepseekV2ForCausalLM, whose real constructors and load_weights take every tensor (q_a and kv_a fused
    in that order), with the trained aux ids and flags."""
    base = make_drafter().config
    config = DrafterConfig(**{**base.__dict__, "mla": MLAShape(32, 24, 16, 8, 16), "target_model_type": "kimi_k2",
                              **flags})
    drafter = Eagle3Drafter(config)
    for p in drafter.parameters():
        torch.nn.init.normal_(p)
    drafter.save_pretrained(tmp_path)
    hf = draft_hf_config(tmp_path)
    assert registry_entry(hf.architectures[0]) == ("deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM")
    assert aux_layer_ids(hf) == {"v2": tuple(AUX), "v1": tuple(AUX)}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    model, record = build_vllm_eagle3_mla(hf, V, LAYERS)
    assert check_vllm_load(model, record, tensors) == []
    assert (model.model.fc_norm is not None, bool(model.model.norm_output)) == (
        flags.get("fc_norm", False), flags.get("norm_output", False))
    fused = model.model.layers[0].self_attn.fused_qkv_a_proj.weight
    assert torch.equal(fused[:32], tensors["midlayer.self_attn.q_a_proj.weight"].float())
    assert torch.equal(fused[32:], tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"].float())


def test_vllm_llama_target_captures_the_input_of_each_id_as_we_train_on():
    """The ids our export writes are the layers vLLM's Llama target returns as aux states: its real capture loop
    over a transformers Llama gives hidden_states[k] (the input of layer k) for id k, in id order."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=LAYERS, vocab_size=V, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    got = vllm_llama_capture(model, ids, AUX)
    assert len(got) == len(AUX)
    for layer, state in zip(AUX, got, strict=True):
        torch.testing.assert_close(state, want[layer][0], atol=1e-5, rtol=1e-5)
