"""A tiny Kimi-K2.5 built on the spot: the released checkpoint's layout at toy widths, no download.

What is kept from the public config (configs/targets/kimi-k2.5/config.json) and what is shrunk:
- kept: the multimodal wrapper (`KimiK25ForConditionalGeneration`, model_type kimi_k25, auto_map to remote
  code, vision_config beside text_config); text_config's DeepSeek-V3 architecture (model_type kimi_k2) with
  **61 layers**, `first_k_dense_replace` 1 (layer 0 dense, 1-60 MoE), one shared expert, sigmoid routing with
  `noaux_tc`, n_group/topk_group 1, `routed_scaling_factor`, yarn rope (factor 64 from 4096, theta 50000),
  untied embeddings; weight names under `language_model.` (per-expert `mlp.experts.N.*_proj`, the router's
  `e_score_correction_bias`), sharded with a `model.safetensors.index.json`, plus vision-tower and projector
  tensors that a text-only load must skip.
- shrunk: hidden 7168 -> 32, heads 64 -> 4 (kv heads = heads, as in Kimi), q/kv LoRA ranks 1536/512 -> 16/16,
  nope/rope/v head dims 128/64/128 -> 8/8/8, experts 384 top-8 -> 8 top-2, MLPs 18432/2048 -> 64/16, vocab 163840 ->
  SmolLM2's BPE plus Kimi's special tokens, padded to a multiple of 64 as Kimi pads its own (so the model's vocab is
  larger than the tokenizer's, as in the real one), the vision tower to two tensors.
- left out: the int4 `quantization_config` (these weights are plain fp32; a packed checkpoint's `weight_packed`
  names would make our loader stop on missing weights rather than load it wrongly).
- tokenizer: a remote-code class (`tokenization_kimi.TinyKimiTokenizer`, named by `auto_map`, loadable only with
  trust_remote_code, as Kimi's TikToken tokenizer), over SmolLM2's BPE with Kimi's role and thinking tokens, and a
  chat template in Kimi-K2.5's format: `<|im_user|>user<|im_middle|>...<|im_end|>`, the assistant's reasoning in
  `<think>...</think>` for the latest answer and an empty `<think></think>` for earlier ones, and a generation
  prompt that opens `<think>` (thinking on; `thinking: false` closes it at once).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KIMI_CONFIG = ROOT / "configs/targets/kimi-k2.5/config.json"

SHRUNK_TEXT = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   initializer_range=0.15)
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
           "[PAD]"]
THINK = ["<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.last and m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- else -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")

TOKENIZER_CODE = '''"""Tiny Kimi tokenizer: remote code, as Kimi-K2.5's own TikTokenTokenizer is (tests/tiny_kimi.py)."""
from transformers import PreTrainedTokenizerFast


class TinyKimiTokenizer(PreTrainedTokenizerFast):
    """SmolLM2's BPE with Kimi's role and thinking tokens, read from a file only this class names (Kimi's own
    reads tiktoken.model), so the dir has no tokenizer.json that transformers could load without this code."""

    vocab_files_names = {"vocab_file": "tiny_kimi_bpe.json"}

    def __init__(self, vocab_file=None, **kwargs):
        super().__init__(tokenizer_file=vocab_file, **kwargs)
'''


def _tokenizer(smollm2_dir: Path, out: Path):
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    tok.add_special_tokens({"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
                            "additional_special_tokens": SPECIAL[2:7]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    (out / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    (out / "tokenizer.json").rename(out / "tiny_kimi_bpe.json")
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(tokenizer_class="TinyKimiTokenizer",
              auto_map={"AutoTokenizer": [None, "tokenization_kimi.TinyKimiTokenizer"]})
    tc_path.write_text(json.dumps(tc, indent=2))
    return tok


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                 indent=2))


def build_tiny_kimi(out: Path, smollm2_dir: Path, reference: Path, seed: int = 0) -> Path:
    """Write the tiny Kimi-K2.5 model dir to `out` (config, sharded weights, remote-code tokenizer), and its
    language model as a plain DeepSeek-V3 checkpoint to `reference` (transformers' own save: the reference
    forward tests compare against, loaded without any of our code)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(smollm2_dir, out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    wrapper = json.loads(KIMI_CONFIG.read_text())
    wrapper.pop("quantization_config")
    vocab = 64 * math.ceil(len(tok) / 64)
    token_ids = dict(bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"])
    text = {**wrapper["text_config"], **SHRUNK_TEXT, **token_ids, "vocab_size": vocab}
    vision = {**wrapper["vision_config"], "text_hidden_size": SHRUNK_TEXT["hidden_size"], "vt_hidden_size": 16,
              "mm_hidden_size": 16, "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1}
    wrapper.update(text_config=text, vision_config=vision, media_placeholder_token_id=ids["<|im_system|>"],
                   **token_ids)
    (out / "config.json").write_text(json.dumps(wrapper, indent=2))
    GenerationConfig(bos_token_id=ids["[BOS]"], eos_token_id=[ids["[EOS]"], ids["<|im_end|>"]],
                     pad_token_id=ids["[PAD]"]).save_pretrained(out)

    keys = {k: v for k, v in text.items() if k not in ("model_type", "auto_map", "architectures")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **keys), dtype=torch.float32)
    model.save_pretrained(reference)  # transformers writes the original per-expert checkpoint names
    tensors = {f"language_model.{k}": v for f in sorted(reference.glob("*.safetensors")) for k, v in load_file(f).items()}
    g = torch.Generator().manual_seed(seed)
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 14, 14, generator=g)
    tensors["mm_projector.proj.0.weight"] = torch.randn(32, 64, generator=g)
    _save_sharded(tensors, out, shards=3)
    return out
