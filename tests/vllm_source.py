"""Check exports against the REAL vLLM 0.33.0 and speculators 0.9.0 source, read at test time.

vLLM cannot run here (it pins torch 2.14 and needs CUDA), but what decides whether it serves our drafter
as trained is plain Python: its config readers (imported for real from the unpacked wheel: they import
nothing a CPU machine lacks), the aux-layer lookup of both model runners, the capture loop of its Llama
target, and the EAGLE-3 draft classes with their `load_weights` (compiled from the source over stand-in
parallel layers, which copy what vLLM's weight loaders would copy into the slice each shard names).
Speculators' own pydantic config classes are imported from its unpacked wheel.

The wheels are fetched once into the cache (tests/engine_source.py; vLLM's Python files only).
"""

import ast
import fcntl
import functools
import importlib
import itertools
import os
import re
import sys
import types
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from core.drafters.drafter_config import SPECULATORS_VERSION
from tests.engine_source import SourceTree, cached_package
from tests.stand_in_layers import LoadRecord, SiluAndMul, load_problems, stand_in_layers

VLLM_VERSION = "0.33.0"
EAGLE3_FILE = "model_executor/models/llama_eagle3.py"
LLAMA_FILE = "model_executor/models/llama.py"
DEEPSEEK_EAGLE3_FILE = "model_executor/models/deepseek_eagle3.py"
DEEPSEEK_FILE = "model_executor/models/deepseek_v2.py"
UTILS_FILE = "model_executor/models/utils.py"
INTERFACES_FILE = "model_executor/models/interfaces.py"
REGISTRY_FILE = "model_executor/models/registry.py"
SPEC_CONFIG_FILE = "config/speculative.py"
V2_AUX_FILE = "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
V1_RUNNER_FILE = "v1/worker/gpu_model_runner.py"


def vllm_root() -> Path:
    """The dir holding vllm/ (and its dist-info) of vllm==0.33.0."""
    return cached_package("vllm", VLLM_VERSION, f"vllm/{EAGLE3_FILE}", py_only=True)


def speculators_root() -> Path:
    return cached_package("speculators", SPECULATORS_VERSION, "speculators/models/eagle3/config.py")


VLLM = SourceTree(lambda: vllm_root() / "vllm", f"vllm-{VLLM_VERSION}")


def _import_from(root: Path, module: str) -> types.ModuleType:
    """`module` imported from the unpacked wheel at `root` (appended to sys.path: never shadows what is
    installed; a vllm or speculators package installed here would fail the assertion instead)."""
    if str(root) not in sys.path:
        sys.path.append(str(root))
    mod = importlib.import_module(module)
    assert Path(mod.__file__).is_relative_to(root), f"{module} came from {mod.__file__}, not {root}"
    return mod


# ----------------------------------------------------------------------------- config paths
def draft_hf_config(drafter_dir: Path):
    """The draft model's hf_config vLLM 0.33 builds for `--speculative-config '{"method": "eagle3", "model":
    drafter_dir}'` (and for `vllm serve drafter_dir` of a speculators dir): the real HF config parser
    (transformers_utils/config.py; a speculators config.json goes through SpeculatorsConfig), then, for a plain
    HF config, SpeculativeConfig's EAGLEConfig wrap. get_config's RoPE patching is left out: it imports the
    engine's runtime, and no check here reads RoPE."""
    cfg_mod = _import_from(vllm_root(), "vllm.transformers_utils.config")
    _, hf = cfg_mod.get_config_parser("hf").parse(str(drafter_dir), trust_remote_code=False)
    eagle = _import_from(vllm_root(), "vllm.transformers_utils.configs.eagle")
    speculators = _import_from(vllm_root(), "vllm.transformers_utils.configs.speculators")
    wrap = re.search(r"if isinstance\(\s*self\.draft_model_config\.hf_config,\s*\(EAGLEConfig, SpeculatorsConfig\),"
                     r"\s*\):\s*pass\s*else:\s*eagle_config = EAGLEConfig\(\s*self\.draft_model_config\.hf_config,"
                     r"\s*method=self\.method,\s*model_type=\"eagle\",", VLLM.text(SPEC_CONFIG_FILE))
    assert wrap, f"{VLLM.label}/{SPEC_CONFIG_FILE} no longer wraps a plain draft config in EAGLEConfig: re-read it"
    if isinstance(hf, (eagle.EAGLEConfig, speculators.SpeculatorsConfig)):
        return hf
    return eagle.EAGLEConfig(hf, method="eagle3", model_type="eagle")


def serve_alone(drafter_dir: Path) -> tuple[str, dict | None]:
    """(the target vLLM 0.33 loads, its speculative config) for `vllm serve <drafter_dir>` with no other flag:
    the real maybe_override_with_speculators."""
    cfg_mod = _import_from(vllm_root(), "vllm.transformers_utils.config")
    model, _, spec = cfg_mod.maybe_override_with_speculators(str(drafter_dir), str(drafter_dir), False)
    return model, spec


def registry_entry(architecture: str) -> tuple[str, str]:
    """(module, class) vLLM's model registry maps a draft architecture to (the _SPECULATIVE_DECODING_MODELS literal)."""
    for node in VLLM.parse(REGISTRY_FILE).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_SPECULATIVE_DECODING_MODELS"]:
            table = ast.literal_eval(node.value)
            assert architecture in table, f"{architecture} is not a speculative-decoding model of vLLM {VLLM_VERSION}"
            return table[architecture]
    raise AssertionError(f"_SPECULATIVE_DECODING_MODELS not found in {VLLM.label}/{REGISTRY_FILE}")


def aux_layer_ids(hf_config) -> dict[str, tuple[int, ...] | None]:
    """The aux layer ids each model runner of vLLM 0.33 reads from a draft config (None: the target's default
    (2, L//2, L-3) instead): V2 (the default runner) and V1, their real functions."""
    spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf_config))
    v2 = VLLM.compile_function(V2_AUX_FILE, None, "get_eagle3_aux_layers_from_config", {})
    v1 = VLLM.compile_function(V1_RUNNER_FILE, "GPUModelRunner", "_get_eagle3_aux_layers_from_config", {})
    return {"v2": v2(spec), "v1": v1(types.SimpleNamespace(speculative_config=spec))}


def speculators_config_class():
    """speculators 0.9's Eagle3SpeculatorConfig, imported from its wheel without the package's __init__ (which
    imports its trainer's dependencies: openai, datasets, ...)."""
    root = speculators_root()
    if str(root) not in sys.path:
        sys.path.append(str(root))  # its version() reads the dist-info
    for name, sub in (("speculators", ""), ("speculators.models", "/models"),
                      ("speculators.models.eagle3", "/models/eagle3")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root / "speculators") + sub]
            sys.modules[name] = pkg
    config = importlib.import_module("speculators.config")
    sys.modules["speculators"].SpeculatorModelConfig = config.SpeculatorModelConfig
    eagle3 = importlib.import_module("speculators.models.eagle3.config")
    assert Path(eagle3.__file__).is_relative_to(root), eagle3.__file__
    config.reload_schemas()
    return eagle3.Eagle3SpeculatorConfig


# ----------------------------------------------------------------------------- the target's aux capture
def vllm_llama_capture(hf_model, input_ids: torch.Tensor, layer_ids: Iterable[int]) -> list[torch.Tensor]:
    """The aux hidden states vLLM 0.33's Llama target returns for `layer_ids`: the real LlamaModel.forward
    (llama.py) and EagleModelMixin capture (interfaces.py: set, sorted, `hidden + residual`) run over the decoder
    layers of a transformers Llama (`hf_model`), each wrapped to vLLM's (positions, hidden, residual) call."""
    inner = hf_model.model
    positions = torch.arange(input_ids.shape[-1])[None]
    rope = inner.rotary_emb(inner.embed_tokens(input_ids), positions)

    class Layer(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, positions, hidden, residual):  # vLLM's [T, H] rows of one sequence
            stream = hidden if residual is None else hidden + residual
            out = self.layer(stream[None], position_embeddings=rope, position_ids=positions[None])
            out = (out[0] if isinstance(out, tuple) else out)[0]
            return out - stream, stream  # vLLM's split: their sum is the residual stream

    mixin = VLLM.compile_class(INTERFACES_FILE, "EagleModelMixin", {"torch": torch, "ClassVar": object})
    forward = VLLM.compile_function(LLAMA_FILE, "LlamaModel", "forward", {
        "get_pp_group": lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True), "islice": islice})

    class Target(nn.Module, mixin):
        def _cache_aux_pp_layout(self):  # one pipeline stage: nothing to lay out
            pass

        def collect_remote_aux_hidden_states(self, intermediate_tensors):
            return []

    model = Target()
    model.layers = nn.ModuleList(Layer(layer) for layer in inner.layers)
    model.start_layer, model.end_layer = 0, len(inner.layers)
    model.embed_input_ids = inner.embed_tokens
    model.norm = lambda hidden, residual: (inner.norm(hidden + residual), None)
    model._set_aux_hidden_state_layers(tuple(layer_ids))
    with torch.no_grad():
        _, aux = forward(model, input_ids[0], positions[0], None)
    return aux


# ----------------------------------------------------------------------------- the draft model's weights
def _add_real_loader(ns: dict, record: LoadRecord) -> None:
    """vLLM's WeightsMapper and AutoWeightsLoader (utils.py), compiled from the source into `ns`."""
    def default_weight_loader(param, loaded):
        assert param.size() == loaded.size(), f"loading {tuple(loaded.shape)} into {tuple(param.shape)}"
        param.data.copy_(loaded)
        record.copies.append(("<default>", None, loaded.data_ptr()))

    ns.update({"re": re, "itertools": itertools, "dataclass": dataclass, "field": field, "replace": replace,
               "default_weight_loader": default_weight_loader,
               "support_quantized_model_reload_from_hp_weights": lambda f: f,
               "StageMissingLayer": type("StageMissingLayer", (nn.Module,), {}),
               "PPMissingLayer": type("PPMissingLayer", (nn.Identity,), {})})
    for fn in ("maybe_prefix", "_get_tied_embedding_params", "extract_layer_index", "process_eagle_weight"):
        ns[fn] = VLLM.compile_function(UTILS_FILE, None, fn, ns)
    ns["WeightsMapper"] = dataclass(VLLM.compile_class(UTILS_FILE, "WeightsMapper", ns))
    ns["AutoWeightsLoader"] = VLLM.compile_class(UTILS_FILE, "AutoWeightsLoader", ns)


def _stand_in_attention(ns: dict) -> None:
    """vLLM's Attention over one sequence with its KV cache (each call's rows see every earlier call's and,
    causally, their own; grouped KV heads) and get_rope's Neox rotation (what llama.py asks for:
    is_neox_style=True, rope_parameters' theta)."""
    class Attention(nn.Module):
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **_):
            super().__init__()
            self.heads, self.d, self.scale, self.kv = num_heads, head_size, scale, num_kv_heads or num_heads
            self.cache = None

        def forward(self, q, k, v):
            t = q.shape[0]
            q, k, v = (x.view(t, n, self.d).transpose(0, 1) for x, n in ((q, self.heads), (k, self.kv), (v, self.kv)))
            if self.cache is not None:
                k, v = torch.cat([self.cache[0], k], 1), torch.cat([self.cache[1], v], 1)
            self.cache = (k, v)
            past = k.shape[1] - t
            mask = torch.arange(k.shape[1])[None] <= torch.arange(past, past + t)[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            return out.transpose(0, 1).reshape(t, self.heads * self.d)

    class NeoxRope(nn.Module):
        def __init__(self, head_size, max_position=None, rope_parameters=None, is_neox_style=True, **_):
            super().__init__()
            assert (rope_parameters or {}).get("rope_type", "default") == "default"
            self.d, self.theta, self.neox = head_size, float(rope_parameters["rope_theta"]), is_neox_style

        def forward(self, positions, q, k):
            assert self.neox, "only the Llama layer's (Neox) rotation runs here"
            inv = 1.0 / self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
            ang = positions.float()[:, None] * inv[None]
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

            def rot(x):
                x = x.view(x.shape[0], -1, self.d)
                half = torch.cat([-x[..., self.d // 2:], x[..., :self.d // 2]], -1)
                return (x * cos[:, None] + half * sin[:, None]).flatten(1)
            return rot(q), rot(k)

    ns.update({"Attention": Attention, "EncoderOnlyAttention": Attention, "get_rope": NeoxRope})


def _draft_namespace(hf_config, target_vocab_size: int, target_layers: int) -> tuple[dict, types.SimpleNamespace,
                                                                                     LoadRecord]:
    """Globals for vLLM's draft classes: the real loader classes, the stand-in layers and a VllmConfig of tensor
    parallel 1 whose draft model config is `hf_config` -> (namespace, vllm_config, record)."""
    record = LoadRecord()
    vllm_config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf_config),
                                                 parallel_drafting=False),
        model_config=types.SimpleNamespace(get_total_num_hidden_layers=lambda: target_layers, hf_config=hf_config,
                                           get_vocab_size=lambda: target_vocab_size, dtype=torch.float32),
        parallel_config=types.SimpleNamespace(dcp_q_replicate=False, decode_context_parallel_size=1,
                                              prefill_context_parallel_size=1),
        cache_config=None, quant_config=None)
    ns = {"torch": torch, "nn": nn, "getattr": getattr, "Mapping": Mapping, "Iterable": Iterable,
          "Callable": Callable, "SiluAndMul": SiluAndMul,
          "logger": types.SimpleNamespace(debug=lambda *a: None, warning=lambda *a: None,
                                         warning_once=lambda *a: None, info=lambda *a: None),
          "AttentionType": types.SimpleNamespace(DECODER="decoder", ENCODER_ONLY="encoder_only"),
          "get_tensor_model_parallel_world_size": lambda: 1, "get_draft_quant_config": lambda vllm_config: None,
          "get_current_vllm_config": lambda: vllm_config, "supports_any_eagle": lambda model: True,
          "LogitsProcessor": _LogitsProcessor,
          "maybe_fused_act_quant": lambda act_fn, x, linear: act_fn(x)}  # unquantised: the plain activation
    ns.update(stand_in_layers(record))
    _stand_in_attention(ns)
    _add_real_loader(ns, record)
    return ns, vllm_config, record


def build_vllm_eagle3(hf_config, target_vocab_size: int, target_layers: int):
    """vLLM 0.33's Eagle3LlamaForCausalLM for this draft hf_config, built by its real constructors (llama_eagle3.py
    over llama.py's decoder layer, attention and MLP) on the stand-in layers, tensor parallel 1 -> (model, record
    of its weight loaders)."""
    ns, vllm_config, record = _draft_namespace(hf_config, target_vocab_size, target_layers)
    for name in ("LlamaMLP", "LlamaAttention", "LlamaDecoderLayer"):
        ns[name] = VLLM.compile_class(LLAMA_FILE, name, ns)
    eagle = {**ns, "_Eagle3LlamaDecoderLayerBase": ns["LlamaDecoderLayer"], "_Eagle3LlamaForCausalLMBase": nn.Module}
    for name in ("LlamaDecoderLayer", "LlamaModel", "Eagle3LlamaForCausalLM"):
        eagle[name] = VLLM.compile_class(EAGLE3_FILE, name, eagle)
    return eagle["Eagle3LlamaForCausalLM"](vllm_config=vllm_config, prefix=""), record


def build_vllm_eagle3_mla(hf_config, target_vocab_size: int, target_layers: int):
    """vLLM 0.33's Eagle3DeepseekV2ForCausalLM (deepseek_eagle3.py over deepseek_v2.py's MLA attention and MLP),
    built by its real constructors on the stand-in layers -> (model, record). Its weights and flags only: vLLM's
    MLA attention runs in its own kernels (not stood in here)."""
    ns, vllm_config, record = _draft_namespace(hf_config, target_vocab_size, target_layers)
    ns.update({"DeepSeekV2FusedQkvAProjLinear": ns["MergedColumnParallelLinear"], "ColumnParallelLinear":
               ns["RowParallelLinear"], "DCPGroupColumnParallelLinear": ns["RowParallelLinear"],
               "envs": types.SimpleNamespace(is_set=lambda name: False), "hasattr": hasattr,
               "MLAModules": types.SimpleNamespace, "MultiHeadLatentAttentionWrapper": lambda *a, **k: nn.Identity(),
               "yarn_get_mscale": lambda *a: 1.0, "LocalArgmaxMixin": type("LocalArgmaxMixin", (), {}), "DeepseekV2ForCausalLM": nn.Module})
    for name in ("DeepseekV2MLP", "DeepseekV2MLAAttention"):
        ns[name] = VLLM.compile_class(DEEPSEEK_FILE, name, ns)
    for name in ("DeepseekV2Eagle3DecoderLayer", "DeepseekV2Eagle3Model", "Eagle3DeepseekV2ForCausalLM"):
        ns[name] = VLLM.compile_class(DEEPSEEK_EAGLE3_FILE, name, ns)
    return ns["Eagle3DeepseekV2ForCausalLM"](vllm_config=vllm_config, prefix=""), record


class _LogitsProcessor:
    def __init__(self, vocab_size, scale=1.0, **_):
        self.scale = scale

    def __call__(self, lm_head, hidden):
        return F.linear(hidden, lm_head.weight) * self.scale


def check_vllm_load(model, record: LoadRecord, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems of loading `tensors` into a model build_vllm_eagle3 built, by its real load_weights ([] = none):
    a tensor it drops without a word, a parameter it leaves uninitialised (NaN here), a misshapen shard (raised
    by the stand-in loaders). vLLM shares the target's embedding when the checkpoint has none, and never reads
    t2d (its load_weights skips it)."""
    problems = load_problems(model, record, tensors, "vLLM", unread=("t2d",),
                             shared=("model.embed_tokens.weight",))
    if getattr(model, "has_own_embed_tokens", False) and torch.isnan(model.model.embed_tokens.weight).any():
        problems.append("model.embed_tokens.weight: never loaded (stays uninitialised)")
    if not getattr(model, "has_own_lm_head", False):
        problems.append("vLLM would use the target's lm_head: the checkpoint's was not seen")
    return problems


# ----------------------------------------------------------------------------- hidden-states extraction
CONNECTOR_FILE = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
COMPLETION_PROTOCOL_FILE = "entrypoints/openai/completion/protocol.py"
COMPLETION_SERVING_FILE = "entrypoints/openai/completion/serving.py"
ENGINE_SERVING_FILE = "entrypoints/serve/engine/serving.py"
INPUT_PROCESSOR_FILE = "v1/engine/input_processor.py"


class _ConnectorBase:
    """KVConnectorBase_V1's metadata slot, which the connector's scheduler and worker halves pass through."""
    _connector_metadata = None

    def _get_connector_metadata(self):
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None


def hidden_states_connector(storage_dir: Path, use_lock: bool = True):
    """vLLM 0.33's ExampleHiddenStatesConnector, compiled from its source, state set as its __init__ sets it for
    tensor parallel rank 0 (its __init__ itself needs the engine): build_connector_meta, wait_for_save,
    request_finished and _write_tensors are the release's own. -> (connector, its module namespace)."""
    ns = {"os": os, "fcntl": fcntl, "torch": torch, "save_file": save_file, "load_file": load_file,
          "dataclass": dataclass, "field": field, "partial": functools.partial, "Any": object,
          "logger": types.SimpleNamespace(info=lambda *a: None, warning=lambda *a: None, error=lambda *a: None),
          "KVConnectorBase_V1": _ConnectorBase, "SupportsHMA": type("SupportsHMA", (), {}),
          "KVConnectorMetadata": type("KVConnectorMetadata", (), {})}
    for name in ("PendingSave", "ExampleHiddenStatesConnectorMetadata"):
        ns[name] = dataclass(VLLM.compile_class(CONNECTOR_FILE, name, ns))
    connector = object.__new__(VLLM.compile_class(CONNECTOR_FILE, "ExampleHiddenStatesConnector", ns))
    connector.__dict__.update(_storage_path=str(storage_dir), _pending_saves={}, _request_filenames={},
                              _lock_fds={}, _is_tp_rank_zero=True, use_lock=use_lock, allow_custom_save_path=False)
    return connector, ns


def connector_file_keys() -> set[str]:
    """The tensor names of the connector's file: the keys of the dict _submit_async_write hands the writer."""
    node = VLLM.method(CONNECTOR_FILE, "ExampleHiddenStatesConnector", "_submit_async_write")
    dicts = [n for n in ast.walk(node) if isinstance(n, ast.Assign) and any(
        getattr(t, "id", None) == "tensors" for t in n.targets) and isinstance(n.value, ast.Dict)]
    assert len(dicts) == 1, f"_submit_async_write in {VLLM.label}/{CONNECTOR_FILE} no longer builds one `tensors` dict"
    return {k.value for k in dicts[0].value.keys}


def completion_fields() -> dict[str, set[str]]:
    """Field names of vLLM's non-streaming completion answer and of its choices (protocol.py)."""
    def fields(cls):
        return {n.target.id for n in VLLM.cls(COMPLETION_PROTOCOL_FILE, cls).body if isinstance(n, ast.AnnAssign)}
    return {"response": fields("CompletionResponse"), "choice": fields("CompletionResponseChoice")}


def internal_request_id(header_id: str) -> str:
    """The engine's id of a completion sent with `X-Request-Id: header_id` (its first prompt): serving.py's
    `cmpl-<base id>`, `-<prompt index>`, and input_processor's 8 random characters, as the source spells them."""
    base = VLLM.compile_function(ENGINE_SERVING_FILE, "BaseServing", "_base_request_id",
                                 {"random_uuid": lambda: "unused"})
    raw = types.SimpleNamespace(headers={"X-Request-Id": header_id})
    serving = VLLM.text(COMPLETION_SERVING_FILE)
    assert 'request_id = f"cmpl-{self._base_request_id(raw_request, request.request_id)}"' in serving
    assert 'request_id_item = f"{request_id}-{i}"' in serving
    request = types.SimpleNamespace(external_req_id=None, request_id=f"cmpl-{base(raw, None)}-0")
    assign = VLLM.compile_function(INPUT_PROCESSOR_FILE, "InputProcessor", "assign_request_id", {
        "envs": types.SimpleNamespace(VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=False), "logger": None,
        "random_uuid": lambda: uuid.uuid4().hex})
    assign(request)
    return request.request_id


def vllm_deepseek_capture(hf_model, input_ids: torch.Tensor, layer_ids: Iterable[int]) -> list[torch.Tensor]:
    """The aux states vLLM 0.33's DeepSeek-V2/V3 model (what Kimi-K2.5's language model runs) returns for
    `layer_ids`: the real DeepseekV2Model.forward (deepseek_v2.py: id k taken before layer k, id L after the last
    layer) over the decoder layers of a transformers DeepseekV3, each wrapped to vLLM's call."""
    inner = hf_model.model
    positions = torch.arange(input_ids.shape[-1])[None]
    rope = inner.rotary_emb(inner.embed_tokens(input_ids), positions)

    class Layer(nn.Module):
        use_sequence_parallel_moe = False

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, positions, hidden, residual, llama_4_scaling=None):
            stream = hidden if residual is None else hidden + residual
            out = self.layer(stream[None], position_embeddings=rope, position_ids=positions[None])
            out = (out[0] if isinstance(out, tuple) else out)[0]
            return out - stream, stream

    forward = VLLM.compile_function(DEEPSEEK_FILE, "DeepseekV2Model", "forward", {
        "get_pp_group": lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True), "islice": islice,
        "getattr": getattr})
    model = types.SimpleNamespace(layers=[Layer(layer) for layer in inner.layers], start_layer=0,
                                  end_layer=len(inner.layers), aux_hidden_state_layers=tuple(layer_ids),
                                  config=types.SimpleNamespace(), embed_input_ids=inner.embed_tokens,
                                  norm=lambda hidden, residual: (inner.norm(hidden + residual), None))
    with torch.no_grad():
        _, aux = forward(model, input_ids[0], positions[0], None)
    return aux
