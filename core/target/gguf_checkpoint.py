"""Turn a llama-architecture GGUF into a Hugging Face Llama checkpoint dir, in seconds.

transformers can do this itself (`from_pretrained(..., gguf_file=...)` then `save_pretrained`), but for
llama it re-parses all the metadata, 98k tokenizer strings included, for the config, the tokenizer and
the model separately, each time through np.memmap slices: ~30 s for SmolLM2-135M on a small CPU. This
reads the file once and writes what that path writes (same tensors, config, generation config,
tokenizer), except for one deliberate fix: digits split as llama.cpp splits them (byte_level_tokenizer);
tests/test_gguf_checkpoint.py holds the two to equality, tests/test_tokenizer_parity.py to llama.cpp.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from core.run.errors import UserError

_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_PER_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# llama.<key> -> LlamaConfig field, as transformers' GGUF loader maps them
_CONFIG_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "rope.dimension_count": "head_dim", "rope.freq_base": "rope_theta",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
_TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "unknown_token_id": "unk", "padding_token_id": "pad"}
# tokenizer.ggml.pre values for which transformers keeps GPT-2's ByteLevel split regex
_GPT2_SPLIT_PRE = {"gpt-2", "smollm"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types: special token, added non-special token


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its np.memmap: the memmap subclass's Python hooks on
    every slice make the stock reader ~3x slower on a vocabulary this size."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain = mapped.view(np.ndarray)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m is None or m[2] not in _PER_LAYER:
        raise UserError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{m[1]}.{_PER_LAYER[m[2]]}.weight"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, it interleaves HF's two rotary halves
    (rows i and i + d/2 become neighbours); this splits them back."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_config_kwargs(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """LlamaConfig kwargs with the values transformers' GGUF loader derives from this metadata."""
    if meta["general.architecture"] != "llama":
        raise UserError(f"GGUF architecture {meta['general.architecture']!r} is not llama")
    kwargs = {field: meta[f"llama.{key}"] for key, field in _CONFIG_KEYS.items() if f"llama.{key}" in meta}
    kwargs.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    kwargs.update({f"{name}_token_id": meta[f"tokenizer.ggml.{key}"] for key, name in _TOKEN_IDS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    kwargs["tie_word_embeddings"] = "output.weight" not in tensor_names
    kwargs["_model_name_or_path"] = meta.get("general.name")  # transformers records the GGUF's model name
    return kwargs


def llama_state_dict(reader: GGUFReader, n_head: int, n_kv_head: int) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 under its HF name, q/k rows un-permuted."""
    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = unpermute_rows(w, n_head if ".attn_q." in t.name else n_kv_head)
        state[hf_tensor_name(t.name)] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    return state


def byte_level_tokenizer(meta: dict[str, Any]):
    """The tokenizer transformers builds from a gpt2-type (byte-level BPE) GGUF vocabulary, except that a
    `smollm` pre-tokenizer splits digits one by one, as llama.cpp does (transformers 5.23 drops that
    step, so "\\n\\n1" became two newline tokens where llama.cpp and SmolLM2's original tokenizer make one:
    a drafter trained on such ids would be served on other ids; tests/test_tokenizer_parity.py)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    kind, pre = meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _GPT2_SPLIT_PRE or _USER_DEFINED in types \
            or not set("".join(tokens)) <= set(bytes_to_unicode().values()):
        raise UserError(f"GGUF tokenizer {kind!r}/{pre!r}: only byte-level BPE with GPT-2's split, "
                         "byte-alphabet tokens and no user-defined tokens is supported")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":  # llama.cpp's smollm split (and SmolLM2's own tokenizer.json): each digit alone first
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, token_type in zip(tokens, types, strict=True) if token_type == _CONTROL])
    specials = {f"{name}_token": tokens[meta[f"tokenizer.ggml.{key}"]] for key, name in _TOKEN_IDS.items()
                if f"tokenizer.ggml.{key}" in meta}
    flags = {k: meta[f"tokenizer.ggml.{k}"] for k in ("add_bos_token", "add_eos_token") if f"tokenizer.ggml.{k}" in meta}
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
                                   **specials, **flags)


def convert_gguf_to_hf(gguf_path: Path, out: Path) -> None:
    """Write model.safetensors (fp32), config.json, generation_config.json and the tokenizer into out."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    reader = _PlainArrayReader(gguf_path)
    meta = read_metadata(reader)
    config = LlamaConfig(**llama_config_kwargs(meta, {t.name for t in reader.tensors}))
    config.architectures, config.dtype = ["LlamaForCausalLM"], torch.float32
    state = llama_state_dict(reader, config.num_attention_heads, config.num_key_value_heads)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    byte_level_tokenizer(meta).save_pretrained(out)
