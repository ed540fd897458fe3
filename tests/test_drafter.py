"""Drafter shapes, overfitting one batch, the metric sums, and the SGLang export format (TTT == decode-time
drafting is proven through the production functions in test_draft_alignment.py)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from core.drafters.drafter import DraftCache, DrafterConfig, Eagle3Drafter
from tests.sglang_source import (
    EAGLE3_FILE,
    check_drafter_shapes,
    check_drafter_tensor_names,
    run_sglang_load_weights,
    sglang_capture_layers,
    sglang_flags,
    sglang_norm_before_fc,
    source_method_text,
)
from train.draft_vocab import build_draft_vocab, d2t_offsets
from train.ttt_loss import (
    Rows,
    StepOptions,
    TTTObjective,
    step_metrics,
    teacher_argmax_lse,
    teacher_targets,
    ttt_loss,
)

B, T, H, V, VD = 2, 12, 32, 100, 40


def make_drafter(seed=0, vd=VD) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=vd, target_hidden_size=H,
                      aux_layers=[2, 3, 5], target_model_type="llama", rope_theta=10000.0)
    d = Eagle3Drafter(c)
    draft_ids, t2d, _ = build_draft_vocab(torch.arange(V, 0, -1), vd)
    d.d2t.copy_(d2t_offsets(draft_ids))
    d.t2d.copy_(t2d)
    torch.nn.init.normal_(d.embed_tokens.weight)
    d.aux_scale.copy_(torch.rand(3 * H) * 10 + 0.1)  # the export must fold this into fc.weight
    return d


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VD, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.uint8)
    mask[:, 3:] = 1
    return torch.randn(B, T, 3 * H, generator=g), ids, mask, torch.randn(B, T, H, generator=g)


def teacher_of(d: Eagle3Drafter, final, mask, lm_head):
    argmax, lse = teacher_argmax_lse(final, lm_head)
    return teacher_targets(final, mask, lm_head[d.t2d], d.t2d, argmax, None, lse)


def test_shapes():
    d = make_drafter()
    aux, ids, _, _ = batch()
    q, k, v, res = d.qkv(aux, ids, torch.arange(T)[None].expand(B, T))
    assert q.shape == (B, 4, T, 8) and k.shape == (B, 2, T, 8) and v.shape == k.shape and res.shape == (B, T, H)
    logits, h2 = d(aux, ids, torch.arange(T)[None].expand(B, T), DraftCache(T))
    assert logits.shape == (B, T, VD) and h2.shape == (B, T, H)
    assert d.midlayer.self_attn.q_proj.weight.shape == (32, 2 * H)  # 2H-wide attention input
    assert d.fc.weight.shape == (H, 3 * H) and d.lm_head.weight.shape == (VD, H)
    assert not d.embed_tokens.weight.requires_grad


def test_overfits_one_batch():
    d = make_drafter()
    aux, ids, mask, final = batch()
    lm_head = torch.randn(V, H) * 3
    teacher = teacher_of(d, final, mask, lm_head)
    obj = TTTObjective(d, steps=3, decay=0.8)
    opt = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(150):
        loss, m = obj(aux, ids, mask, teacher)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, m = ttt_loss(d, Rows(aux, ids, mask), teacher, 3, 0.8)
    assert torch.equal(m["correct"], m["count"]), m
    # soft CE floor is the teacher entropy; being far below the start shows it learned
    assert loss.item() < 0.5 * first


def test_metrics_are_ratios_of_summed_counts():
    """Two ranks (or micro-batches): one row all right, 99 rows all wrong -> acc 0.01, not a mean of
    ratios (0.5); the loss is the decay-weighted sum of per-step means."""
    a = {"loss_sum": torch.tensor([2.0, 1.0]), "correct": torch.tensor([1.0, 0.0]), "alpha_sum": torch.tensor([1.0, 0.5]),
         "count": torch.tensor([1.0, 1.0])}
    b = {"loss_sum": torch.tensor([0.0, 0.0]), "correct": torch.tensor([0.0, 0.0]), "alpha_sum": torch.tensor([9.0, 0.0]),
         "count": torch.tensor([99.0, 0.0])}
    row = step_metrics({k: a[k] + b[k] for k in a}, decay=0.5)
    assert row["acc_0"] == pytest.approx(0.01) and row["acc_1"] == 0.0
    assert row["loss_0"] == pytest.approx(0.02) and row["loss_1"] == 1.0  # step 1 counted rows on one rank only
    assert row["loss"] == pytest.approx(0.02 + 0.5 * 1.0)
    assert row["alpha_0"] == pytest.approx(0.1) and row["alpha_1"] == 0.5


def test_teacher_drops_targets_outside_draft_vocab():
    d = make_drafter()
    final = torch.randn(1, 4, H)
    lm_head = torch.zeros(V, H)
    lm_head[V - 1] = final[0, 1] * 100  # argmax at position 1 -> token V-1, outside the draft vocab
    in_vocab = teacher_of(d, final, torch.ones(1, 4, dtype=torch.uint8), lm_head).in_vocab
    assert not bool(d.t2d[V - 1]) and in_vocab[0, 1].item() is False


def test_export_matches_sglang_format(tmp_path):
    d = make_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == VD and cfg["num_hidden_layers"] == 1
    assert "target_hidden_size" not in cfg  # draft hidden == target hidden
    # llama: SGLang adds +1 to explicit ids, so [1, 2, 4] makes it capture inputs of layers [2, 3, 5]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "use_aux_hidden_state": True}
    assert sglang_capture_layers("llama.py", cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], 8) == [2, 3, 5]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert check_drafter_tensor_names(tensors) == []
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    hot = run_sglang_load_weights(tensors)["hot_token_id"]
    assert torch.equal(hot, torch.nonzero(d.t2d).flatten())


def test_token_half_computed_once_gives_the_plain_qkv_and_its_gradients():
    """TTT projects the tokens once for all K steps (`token_qkv`, rows k..k+T for step k) and adds the hidden
    half per step: the same q, k, v, residual and weight gradients as the one concatenated projection."""
    d = make_drafter()
    aux, ids, _, _ = batch()
    pos = torch.arange(T)[None].expand(B, T) + 2
    ext = torch.nn.functional.pad(ids, (2, 3), value=7)  # this step's tokens at rows 2..2+T of a longer run
    params = [p for p in d.parameters() if p.requires_grad]
    outs, grads = [], []
    for split in (False, True):
        tq = tuple(y[:, 2:2 + T] for y in d.token_qkv(ext)) if split else None
        out = d.qkv(aux, None if split else ids, pos, tq)
        w = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(out)]
        grads.append(torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w, strict=True)), params,
                                         allow_unused=True))
        outs.append(out)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for p, a, b in zip(params, *grads, strict=True):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, p=p: f"{p.shape}: {m}")


def test_export_round_trip(tmp_path):
    d = make_drafter()
    d.save_pretrained(tmp_path)
    d2 = Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "llama", 8)
    assert d2.config.aux_layers == [2, 3, 5]
    aux, ids, _, _ = batch()
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        a, _ = d(aux, ids, pos, DraftCache(T))
        b, _ = d2(aux, ids, pos, DraftCache(T))
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # bf16 export
    assert torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)


def test_from_pretrained_rejects_tied_head(tmp_path):
    d = make_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tie_word_embeddings must be false"):
        Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "llama", 8)


def make_norm_before_fc_drafter() -> Eagle3Drafter:
    """An EAGLE-3.1 drafter whose input_norm weight and aux_scale are far from 1 (neither is an identity)."""
    d = make_drafter()
    n = Eagle3Drafter(dataclasses.replace(d.config, norm_before_fc=True))
    n.load_state_dict(d.state_dict(), strict=False)
    with torch.no_grad():
        n.input_norm.weight.copy_(torch.rand(3 * H) * 3 + 0.2)
    return n


def massive_aux(seed=2) -> torch.Tensor:
    """Aux like a target's residual streams: most features ~1, a few ~100 (massive activations)."""
    aux = batch(seed)[0] * 2
    aux[..., [3, H + 7, 2 * H + 1]] *= 100
    return aux


def test_norm_before_fc_round_trip(tmp_path):
    """Export -> reload gives the trained drafter's logits: input_norm travels, aux_scale folds into fc
    (not into the norm: norm(x/s) != norm(x)/s), and the reloaded drafter applies the norm before fc."""
    d = make_norm_before_fc_drafter()
    d.save_pretrained(tmp_path)
    d2 = Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "llama", 8)
    assert d2.config.norm_before_fc and d2.input_norm is not None and torch.equal(d2.aux_scale, torch.ones(3 * H))
    _, ids, _, _ = batch()
    aux, pos = massive_aux(), torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        a, _ = d(aux, ids, pos, DraftCache(T))
        b, _ = d2(aux, ids, pos, DraftCache(T))
        plain = Eagle3Drafter(dataclasses.replace(d2.config, norm_before_fc=False))
        plain.load_state_dict({k: v for k, v in d2.state_dict().items() if k != "input_norm.weight"})
        c, _ = plain(aux, ids, pos, DraftCache(T))
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # bf16 export
    assert (a - c).abs().max() > 1.0, "the norm must matter on this aux, or the round trip proves nothing"


def test_norm_before_fc_export_is_what_sglang_loads(tmp_path):
    d = make_norm_before_fc_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and sglang_norm_before_fc(cfg)  # SGLang's own __init__ lines
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["input_norm.weight"].shape == (3 * H,)
    assert check_drafter_tensor_names(tensors, norm_before_fc=True) == []
    # without the flag SGLang builds no input_norm: the weight would be dropped and fc fed un-normed aux
    assert "input_norm.weight" in run_sglang_load_weights(tensors)["ignored"]
    plain = tmp_path / "plain"
    make_drafter().save_pretrained(plain)
    plain_cfg = json.loads((plain / "config.json").read_text())
    assert "norm_before_fc" not in plain_cfg and not sglang_norm_before_fc(plain_cfg)
    assert "input_norm.weight" not in load_file(str(plain / "model.safetensors"))


@pytest.mark.parametrize("change, error", [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "norm_before_fc": False}}, "engines would"),
    ({"norm_before_fc": False}, "unexpected.*input_norm"),  # weights with a norm the config does not ask for
    ({"norm_before_residual": True}, "does not implement"),
])
def test_from_pretrained_refuses_a_model_it_would_not_serve_as_the_engines_do(tmp_path, change, error):
    d = make_norm_before_fc_drafter()
    d.save_pretrained(tmp_path)
    cfg = {**json.loads((tmp_path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=error):
        Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "llama", 8)


def test_loss_decay_weights_each_steps_gradient():
    """The TTT loss is Σ_k decay^k · mean loss of step k, in the value and in the gradient: at K=2 the gradient is
    g0 + decay·g1, linear in decay, so g(1) - g(0.5) = 2 (g(0.5) - g(0.25)) with g1 != 0, and the value equals the
    weighted sum of the per-step means it reports (as computed here from its own sums)."""
    aux, ids, mask, final = batch()
    d = make_drafter()
    teacher = teacher_of(d, final, mask, torch.randn(V, H) * 3)
    grads, values = {}, {}
    for decay in (1.0, 0.5, 0.25):
        d.zero_grad()
        loss, m = ttt_loss(d, Rows(aux, ids, mask), teacher, 2, decay)
        loss.backward()
        grads[decay] = torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
        per_step = m["loss_sum"] / m["count"]
        assert loss.item() == pytest.approx((per_step[0] + decay * per_step[1]).item(), rel=1e-5)
        values[decay] = loss.item()
    g1 = (grads[1.0] - grads[0.5]) / 0.5
    assert g1.abs().max() > 1e-4  # step 1 has a gradient of its own
    torch.testing.assert_close(grads[0.5] - grads[0.25], 0.25 * g1, rtol=1e-3, atol=1e-6)


def test_rope_rotates_as_transformers_llama_does():
    """apply_rope against transformers' own Llama rotary embedding (an implementation we did not write): the same
    angles, the same rotate-half pairing and direction, at positions that differ per row."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from core.drafters.drafter import apply_rope

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 16, generator=g)
    positions = torch.stack([torch.arange(7), torch.arange(7) + 13])
    rot = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=5000.0))
    cos, sin = rot(q, positions)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(apply_rope(q, positions, 5000.0), want, rtol=1e-5, atol=1e-5)


def test_each_norm_takes_its_own_input_in_both_qkv_paths():
    """The attention input is [input_layernorm(embed(token)), hidden_norm(hidden)], each RMSNorm with its own weight,
    computed here by hand; the decode path (tokens) and TTT's (token_qkv, the token half computed once) agree."""
    from core.drafters.drafter import apply_rope

    d = make_drafter()
    layer = d.midlayer
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(torch.rand(H) + 0.5)
        layer.hidden_norm.weight.copy_(torch.rand(H) * 3 + 2)
    g = torch.Generator().manual_seed(5)
    hidden, ids = torch.randn(B, T, H, generator=g), torch.randint(0, VD, (B, T), generator=g)
    pos = torch.arange(T)[None].expand(B, T)

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps) * w

    x = torch.cat([rms(d.embed_tokens(ids), layer.input_layernorm.weight), rms(hidden, layer.hidden_norm.weight)], -1)
    want = apply_rope(layer.self_attn.q_proj(x).view(B, T, 4, 8).transpose(1, 2), pos, d.config.rope_theta)
    with torch.no_grad():
        for q in (d.qkv(hidden, ids, pos)[0], d.qkv(hidden, None, pos, token_qkv=d.token_qkv(ids))[0]):
            torch.testing.assert_close(q, want.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [StepOptions(), StepOptions(loss_chunk=5), StepOptions(prune_rows=True)],
                         ids=["plain", "fused head loss", "pruned rows"])
def test_ttt_gradient_equals_the_numerical_derivative(options):
    """The whole K=3 unroll in float64 weights (fp32 inside the norms and RoPE): autograd's directional derivative of the loss equals the central finite
    difference along a random direction of every trainable weight. Each step reads the previous step's hidden
    state, so a gradient cut there (a stray detach), or any step whose backward differs from its forward,
    makes the two disagree."""
    aux, ids, mask, final = batch()
    d = make_drafter().double()
    teacher = teacher_of(d, final.double(), mask, torch.randn(V, H, dtype=torch.float64) * 3)
    rows = Rows(aux.double(), ids, mask)
    params = [p for p in d.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(5)
    direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    loss, _ = ttt_loss(d, rows, teacher, 3, 0.8, options)
    analytic = sum((grad * v).sum() for grad, v in zip(torch.autograd.grad(loss, params), direction, strict=True))
    eps, moved = 1e-4, []  # the norms and RoPE compute in fp32: a smaller step is rounding
    with torch.no_grad():
        for sign in (1, -1):
            for p, v in zip(params, direction, strict=True):
                p.add_(sign * eps * v)
            moved.append(ttt_loss(d, rows, teacher, 3, 0.8, options)[0])
            for p, v in zip(params, direction, strict=True):
                p.sub_(sign * eps * v)
    numerical = (moved[0] - moved[1]) / (2 * eps)
    assert abs(analytic.item()) > 1e-3
    assert analytic.item() == pytest.approx(numerical.item(), rel=1e-4)  # a gradient cut between steps: 40% off


def make_eagle31_drafter() -> Eagle3Drafter:
    """EAGLE-3.1's fc_norm and norm_output on, the three chunk norms' weights far from 1 and unlike each other."""
    d = make_drafter()
    n = Eagle3Drafter(dataclasses.replace(d.config, fc_norm=True, norm_output=True))
    n.load_state_dict(d.state_dict(), strict=False)
    with torch.no_grad():
        for norm in n.fc_norm:
            norm.weight.copy_(torch.rand(H) * 3 + 0.2)
    return n


def test_fc_norm_normalises_each_aux_chunk_by_hand():
    """fc reads cat(fc_norm[i](aux_i)): each [H] chunk scaled by its own RMS and its own weight, as computed here;
    normalising the concatenation instead (one RMS for all three) gives another input."""
    d, aux = make_eagle31_drafter(), massive_aux()
    chunks = aux.chunk(3, -1)
    by_hand = torch.cat([w * x / (x.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps).sqrt()
                         for w, x in zip((n.weight for n in d.fc_norm), chunks, strict=True)], -1)
    torch.testing.assert_close(d.fc_input(aux), by_hand, rtol=1e-5, atol=1e-5)
    whole = aux / (aux.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps).sqrt()
    whole = whole * torch.cat([n.weight for n in d.fc_norm])
    assert (whole - by_hand).abs().max() > 1.0


def test_eagle31_flags_export_as_sglang_loads_them(tmp_path):
    """fc_norm / norm_output travel as config.json's top-level keys, which SGLang 0.5.23's own __init__ lines read;
    the three chunk norms load by name and shape; the reloaded drafter drafts what the trained one drafts, and
    norm_output changes what a second step reads."""
    d = make_eagle31_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert sglang_flags(cfg) == {"fc_norm": True, "norm_output": True}
    # and what SGLang's draft forward hands the next step with the flag: the normed state, as ours does
    forward = source_method_text(EAGLE3_FILE, "LlamaModel", "forward")
    assert "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in forward
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert [tensors[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(H,)] * 3
    assert check_drafter_tensor_names(tensors, fc_norm=True) == []
    assert check_drafter_shapes(tensors, cfg) == []
    assert "fc_norm.0.weight" in run_sglang_load_weights(tensors)["ignored"]  # without the flag: dropped
    d2 = Eagle3Drafter.from_pretrained(tmp_path, d.embed_tokens.weight.data, "llama", 8)
    assert d2.config.fc_norm and d2.config.norm_output
    _, ids, _, _ = batch()
    aux, pos = massive_aux(), torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        (a, ha), (b, hb) = (m(aux, ids, pos, DraftCache(T)) for m in (d, d2))
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # bf16 export
        plain = Eagle3Drafter(dataclasses.replace(d2.config, norm_output=False))
        plain.load_state_dict(d2.state_dict())
        _, hp = plain(aux, ids, pos, DraftCache(T))
    torch.testing.assert_close(d2.norm(hp), hb)  # norm_output: the next step reads norm(h2), not h2
    assert (hp - hb).abs().max() > 1.0
    plain_dir = tmp_path / "plain"
    make_drafter().save_pretrained(plain_dir)
    assert sglang_flags(json.loads((plain_dir / "config.json").read_text())) == {"fc_norm": False, "norm_output": False}


def test_llamacpp_export_refuses_what_its_converter_would_ignore(tmp_path):
    """llama.cpp b11434's converter reads neither fc_norm nor norm_output: converting such a drafter would serve
    another model, so it is refused in one line naming the flags, before the converter runs."""
    from core.run.errors import UserError
    from eval.llamacpp import convert_drafter

    make_eagle31_drafter().save_pretrained(tmp_path / "d")
    with pytest.raises(UserError, match=r"a drafter with fc_norm and norm_output \(EAGLE-3.1\), which llama.cpp "
                                        r"b11434's converter ignores"):
        convert_drafter(tmp_path / "no-tree", tmp_path / "d", tmp_path / "no-target", tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()
