"""Our aux-layer convention vs what the real SGLang 0.5.23 source captures for the exported ids."""

import pytest

from core.target.aux_layers import (
    aux_layers_from_sglang,
    default_aux_layers,
    resolve_aux_layers,
    sglang_layer_ids,
)
from tests.sglang_source import sglang_capture_layers

CASES = [("llama", "llama.py", 30, [2, 15, 27]), ("llama", "llama.py", 32, [2, 16, 29]),
         ("qwen3", "llama.py", 36, [1, 18, 33]),  # qwen files share llama's +1 rule
         ("kimi_k2", "deepseek_v2.py", 61, [3, 31, 59]), ("deepseek_v3", "deepseek_v2.py", 61, [2, 30, 58])]


@pytest.mark.parametrize("model_type, source, num_layers, aux", CASES)
def test_exported_ids_make_sglang_capture_the_trained_layers(model_type, source, num_layers, aux):
    ids = sglang_layer_ids(aux, model_type)
    assert sglang_capture_layers(source, ids, num_layers) == aux
    assert aux_layers_from_sglang(ids, model_type, num_layers) == aux


def test_kimi_ids_are_passed_unshifted():
    assert sglang_layer_ids([3, 31, 59], "kimi_k2") == [3, 31, 59]


def test_deepseek_cannot_capture_layer_one_explicitly():
    with pytest.raises(ValueError, match="input of layer 1"):
        sglang_layer_ids([1, 30, 58], "deepseek_v3")


def test_default_and_validation():
    assert default_aux_layers(30) == [2, 15, 27] and resolve_aux_layers(None, 30) == [2, 15, 27]
    assert aux_layers_from_sglang(None, "llama", 30) == [2, 15, 27]
    for bad in ([3, 2, 1], [0, 5, 9], [2, 15, 30], [2, 2, 3]):
        with pytest.raises(ValueError, match="extract.aux_layers"):
            resolve_aux_layers(bad, 30)
    with pytest.raises(ValueError, match="unknown"):
        sglang_layer_ids([2, 15, 27], "gpt2")


@pytest.mark.parametrize("model_type, source, num_layers, aux", CASES)
def test_every_engine_reads_the_trained_layers_from_one_export(model_type, source, num_layers, aux):
    """One config.json, two conventions: SGLang captures from eagle_config (its real rule, run here),
    llama.cpp's converter and vLLM read the top-level key as input-of-layer ids. Both must name `aux`,
    and the loader must refuse a config whose two keys disagree (an id shifted by one)."""
    from core.drafters.drafter_config import DrafterConfig

    c = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=100, draft_vocab_size=50, target_hidden_size=64, aux_layers=aux,
                      target_model_type=model_type)
    cfg = c.to_sglang()
    assert sglang_capture_layers(source, cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], num_layers) == aux
    assert cfg["eagle_aux_hidden_state_layer_ids"] == aux
    assert DrafterConfig.from_sglang(cfg, model_type, num_layers).aux_layers == aux
    shifted = {**cfg, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux]}
    with pytest.raises(ValueError, match="the engines would feed the drafter different layers"):
        DrafterConfig.from_sglang(shifted, model_type, num_layers)
    # a drafter from a trainer that writes only the top-level key (vLLM speculators style)
    only_top = {k: v for k, v in cfg.items() if k != "eagle_config"}
    assert DrafterConfig.from_sglang(only_top, model_type, num_layers).aux_layers == aux
