"""core/engine/decode_attention.py against stock SDPA over repeat_kv: the same attention for one query token
(GQA 9 on 3 heads, left padding, both mask formats), stock SDPA itself for longer queries, and on a
loaded target the decode steps really go through it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

import core.engine.decode_attention
from core.engine.decode import decode_one, left_padded, new_cache, prefill
from core.engine.decode_attention import NAME, decode_attention_forward, grouped_decode_attention
from core.run.config import load_config
from core.target.model import load_target
from tests.conftest import ROOT

B, H, KVH, D, L = 4, 9, 3, 16, 24
PADS = [0, 3, 7, 11]  # left padding per row; every row attends to a different set of slots


def inputs(q_len: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, q_len), (KVH, L), (KVH, L)))
    keep = torch.ones(B, 1, q_len, L, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        keep[row, ..., :pad] = False
    return q, k, v, keep


def additive(keep: torch.Tensor) -> torch.Tensor:
    """The eager-style float mask: 0 where attended, the dtype's minimum elsewhere."""
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


def stock(q, k, v, mask) -> torch.Tensor:
    """Query head h reads KV head h // G, through repeat_kv: what transformers' SDPA path computes."""
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, H // KVH), repeat_kv(v, H // KVH),
                                                           attn_mask=mask, scale=D ** -0.5)
    return out.transpose(1, 2)


class Attention(torch.nn.Module):
    num_key_value_groups = H // KVH
    is_causal = True


@pytest.mark.parametrize("fmt", ["bool", "float"])
def test_one_token_equals_sdpa_over_repeated_kv(fmt):
    q, k, v, keep = inputs()
    mask = keep if fmt == "bool" else additive(keep)
    ours = grouped_decode_attention(q, k, v, mask, D ** -0.5)
    assert ours.shape == (B, 1, H, D)
    torch.testing.assert_close(ours, stock(q, k, v, mask), rtol=1e-5, atol=1e-5)
    # the inputs tell head groupings and masks apart: pairing head h with KV head h % KVH, or no mask, differs
    wrong_group = torch.nn.functional.scaled_dot_product_attention(q, k.repeat(1, H // KVH, 1, 1),
                                                                   v.repeat(1, H // KVH, 1, 1), attn_mask=mask)
    assert (ours - wrong_group.transpose(1, 2)).abs().amax() > 0.1
    assert (ours - stock(q, k, v, None)).abs().amax() > 0.1


def test_the_interface_function_passes_longer_queries_to_sdpa_untouched():
    module = Attention()
    q, k, v, keep = inputs(q_len=5)
    ours, _ = decode_attention_forward(module, q, k, v, keep, scaling=D ** -0.5)
    assert torch.equal(ours, sdpa_attention_forward(module, q, k, v, keep, scaling=D ** -0.5)[0])
    q, k, v, keep = inputs(q_len=1, seed=1)
    ours, _ = decode_attention_forward(module, q, k, v, keep, scaling=D ** -0.5)
    torch.testing.assert_close(ours, sdpa_attention_forward(module, q, k, v, keep, scaling=D ** -0.5)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_loaded_target_decodes_through_it_with_the_sdpa_logits(monkeypatch):
    """Left-padded batched prefill and decode steps of the tiny target (GQA 4 on 2 heads): the one-token
    steps call the grouped attention in every layer and give SDPA's logits; the prefill does not."""
    model, _ = load_target(load_config(ROOT / "configs/tiny-random-llama.yaml"))
    assert model.config._attn_implementation == NAME
    calls = []
    grouped = core.engine.decode_attention.grouped_decode_attention
    monkeypatch.setattr(core.engine.decode_attention, "grouped_decode_attention", lambda *a: (calls.append(1), grouped(*a))[1])
    ids, mask, pos = left_padded([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]], model.device)

    def run() -> list[torch.Tensor]:
        cache = new_cache(model, ids.shape[1] + 3)
        full = torch.cat([mask, mask.new_ones(3, 3)], 1)
        with torch.inference_mode():
            logits = [prefill(model, cache, ids, mask, pos)[0]]
            for s in range(3):
                logits.append(decode_one(model, cache, logits[-1].argmax(-1), ids.shape[1] + s,
                                         full[:, : ids.shape[1] + s + 1], pos[:, -1:] + 1 + s))
        return logits

    ours = run()
    assert len(calls) == 3 * model.config.num_hidden_layers
    model.set_attn_implementation("sdpa")
    try:
        sdpa = run()
    finally:
        model.set_attn_implementation(NAME)
    assert len(calls) == 3 * model.config.num_hidden_layers
    for a, b in zip(ours, sdpa, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
