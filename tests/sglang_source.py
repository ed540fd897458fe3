"""Check exports against the REAL SGLang 0.5.23 source, read at test time.

SGLang is not importable on a CPU machine (its package pulls in triton and the CUDA stack), but
the parts that decide whether a drafter checkpoint loads are plain Python. So we unpack the
wheel (no dependencies) into a cache dir (tests/engine_source.py), parse the files with `ast`, and execute the
bodies that matter (`load_weights`, `set_eagle3_layers_to_capture`) against stand-in objects.
A hand-written copy of the loader's name mapping would drift silently; this cannot.

An install failure raises RuntimeError: the tests must fail loudly, never skip.
"""

import ast
import types
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch

from tests.engine_source import SourceTree, cached_package

SGLANG_VERSION = "0.5.23"
EAGLE3_FILE = "srt/models/llama_eagle3.py"
LLAMA_FILE = "srt/models/llama.py"
# Taken from the target model at load time, so a drafter checkpoint need not carry it.
FROM_TARGET = {"model.embed_tokens.weight"}


def sglang_root() -> Path:
    """Path of the `sglang` package dir of sglang==0.5.23, fetched once into the cache."""
    return cached_package("sglang", SGLANG_VERSION, f"sglang/{EAGLE3_FILE}") / "sglang"


SGLANG = SourceTree(sglang_root, f"sglang-{SGLANG_VERSION}")
source_class, source_method, source_method_text = SGLANG.cls, SGLANG.method, SGLANG.method_text
_run_assignments, _compile_method = SGLANG.run_assignments, SGLANG.compile_function


# ----------------------------------------------------------------------------- parameter names
# (file, class, attribute paths the default-config parameter names rely on)
_REQUIRED_ATTRS = [
    (EAGLE3_FILE, "LlamaForCausalLMEagle3", {"model", "lm_head"}),
    (EAGLE3_FILE, "LlamaModel", {"embed_tokens", "fc", "layers", "norm"}),
    (EAGLE3_FILE, "LlamaDecoderLayer", {"hidden_norm", "self_attn.qkv_proj", "mlp"}),
    (LLAMA_FILE, "LlamaDecoderLayer", {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}),
    (LLAMA_FILE, "LlamaAttention", {"qkv_proj", "o_proj"}),
    (LLAMA_FILE, "LlamaMLP", {"gate_up_proj", "down_proj"}),
]


def sglang_eagle3_param_names(num_layers: int = 1, norm_before_fc: bool = False, fc_norm: bool = False) -> set[str]:
    """Parameter names of LlamaForCausalLMEagle3 with default config flags (plus `model.input_norm`
    when norm_before_fc, `model.fc_norm.{0,1,2}` when fc_norm: see sglang_norm_before_fc / sglang_flags for the
    flags themselves).

    Defaults: tie_word_embeddings false, no fc bias. Every module attribute the names rely on is first
    verified to be assigned in the real source.
    """
    required = _REQUIRED_ATTRS + ([(EAGLE3_FILE, "LlamaModel", {"input_norm"})] if norm_before_fc else []) + (
        [(EAGLE3_FILE, "LlamaModel", {"fc_norm"})] if fc_norm else [])
    missing = [f"{cls}.{attr} (sglang/{f})" for f, cls, attrs in required
               for attr in sorted(attrs - SGLANG.self_assigned(f, cls))]
    if missing:
        raise AssertionError(f"SGLang {SGLANG_VERSION} source lacks `self.<attr> = ...` for: {missing}")
    names = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"}
    if norm_before_fc:
        names.add("model.input_norm.weight")
    if fc_norm:  # one per aux hidden state: 3 (the config's eagle_aux_hidden_state_layer_ids)
        names |= {f"model.fc_norm.{i}.weight" for i in range(3)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("input_layernorm.weight", "hidden_norm.weight",
                                  "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                                  "mlp.down_proj.weight")}
    return names


# ----------------------------------------------------------------------------- load_weights
class _StandInParam:
    """Stands in for an nn.Parameter: its weight_loader records instead of copying."""

    def __init__(self, name: str, calls: list):
        self.name, self._calls = name, calls

    def weight_loader(self, param, loaded_weight, shard_id=None):
        self._calls.append((param.name, shard_id, tuple(loaded_weight.shape)))


def sglang_norm_before_fc(config: dict) -> bool:
    """Whether SGLang builds its input_norm for this drafter config.json: the real LlamaModel.__init__
    statements that assign `eagle_config` and `self.norm_before_fc`, run on a stand-in config (SGLang's
    LlamaConfig exposes config.json's top-level keys as attributes)."""
    init = source_method(EAGLE3_FILE, "LlamaModel", "__init__")

    def assigns(node, name):
        return isinstance(node, ast.Assign) and any(
            ast.unparse(t) == name for t in node.targets)

    picked = [n for n in init.body if assigns(n, "eagle_config") or assigns(n, "self.norm_before_fc")]
    if [ast.unparse(n.targets[0]) for n in picked] != ["eagle_config", "self.norm_before_fc"]:
        raise AssertionError(f"LlamaModel.__init__ in sglang/{EAGLE3_FILE} no longer assigns eagle_config, then "
                             "self.norm_before_fc: re-read how SGLang switches norm_before_fc on")
    stand_in = types.SimpleNamespace()
    namespace = {"config": types.SimpleNamespace(**config), "self": stand_in}
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(sglang_root() / EAGLE3_FILE), "exec"), namespace)
    return stand_in.norm_before_fc


def sglang_flags(config: dict) -> dict[str, bool]:
    """{"fc_norm", "norm_output"} as SGLang 0.5.23 switches them on for this drafter config.json: the real
    LlamaModel.__init__ statements that assign `use_fc_norm` and `self.norm_output`, run on a stand-in config."""
    ns = _run_assignments(EAGLE3_FILE, "LlamaModel", "__init__", {"use_fc_norm", "self.norm_output"},
                          {"config": types.SimpleNamespace(**config), "getattr": getattr,
                           "self": types.SimpleNamespace()})
    return {"fc_norm": bool(ns["use_fc_norm"]), "norm_output": bool(ns["self"].norm_output)}


def run_sglang_load_weights(tensors: dict[str, torch.Tensor], num_layers: int = 1,
                            norm_before_fc: bool = False, fc_norm: bool = False) -> dict:
    """Run the real LlamaForCausalLMEagle3.load_weights body over `tensors`.

    Returns {"loaded": {param: [shard ids or None]}, "ignored": [input names the loader dropped],
    "hot_token_id": tensor or None, "calls": [(input name, param, shard id, shape)]}.
    """
    calls: list = []  # (param name, shard id, shape), appended by every weight loader

    def default_weight_loader(param, loaded_weight):  # used only for params without weight_loader
        calls.append((param.name, None, tuple(loaded_weight.shape)))

    namespace = {"torch": torch, "Iterable": Iterable, "Tuple": Tuple, "Optional": Optional,
                 "List": List, "default_weight_loader": default_weight_loader}
    load_weights = _compile_method(EAGLE3_FILE, "LlamaForCausalLMEagle3", "load_weights", namespace)

    params = {n: _StandInParam(n, calls)
              for n in sorted(sglang_eagle3_param_names(num_layers, norm_before_fc, fc_norm))}
    stand_in_self = types.SimpleNamespace(named_parameters=lambda: iter(params.items()), hot_token_id=None)

    per_input: dict[str, list] = {}

    def weights():  # the loader handles each item fully before it pulls the next one
        for name, tensor in tensors.items():
            start = len(calls)
            yield name, tensor
            per_input[name] = calls[start:]

    load_weights(stand_in_self, weights())
    assert list(per_input) == list(tensors), "load_weights did not consume every input tensor"

    loaded: dict[str, list] = {}
    records = []
    for name, got in per_input.items():
        for param_name, shard_id, shape in got:
            loaded.setdefault(param_name, []).append(shard_id)
            records.append((name, param_name, shard_id, shape))
    # The loader's own test is a substring match on "d2t" / "t2d" (both are consumed silently).
    ignored = [n for n, got in per_input.items() if not got and "d2t" not in n and "t2d" not in n]
    return {"loaded": loaded, "ignored": ignored, "hot_token_id": stand_in_self.hot_token_id,
            "calls": records}


def check_drafter_tensor_names(tensors: dict[str, torch.Tensor], num_layers: int = 1,
                               norm_before_fc: bool = False, fc_norm: bool = False) -> list[str]:
    """Problems SGLang's real loader would hit with these tensor names; [] means OK.

    The loader never complains itself: an unknown name is dropped and the parameter keeps its
    random init, so serving runs with a broken drafter. This turns that into a list of errors.
    """
    result = run_sglang_load_weights(tensors, num_layers, norm_before_fc, fc_norm)
    loaded = result["loaded"]
    problems = [f"{n}: ignored by SGLang's load_weights (no such parameter)" for n in result["ignored"]]
    for param in sorted(sglang_eagle3_param_names(num_layers, norm_before_fc, fc_norm) - FROM_TARGET):
        if param not in loaded:
            problems.append(f"{param}: never loaded (stays randomly initialised)")
    expected_shards = {"qkv_proj.weight": ["k", "q", "v"], "gate_up_proj.weight": [0, 1]}
    for param, shards in sorted(loaded.items()):
        want = next((v for k, v in expected_shards.items() if param.endswith(k)), [None])
        if sorted(shards, key=str) != sorted(want, key=str):
            problems.append(f"{param}: loaded with shards {shards}, expected each of {want} once")
    if result["hot_token_id"] is None:
        problems.append("d2t missing: SGLang gets no hot_token_id (draft->target id map)")
    return problems


# ----------------------------------------------------------------------------- aux layer ids
def sglang_capture_layers(model_file: str, layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """Layers SGLang captures for `--return-aux-hidden-state-layer-ids layer_ids`.

    Executes the real `set_eagle3_layers_to_capture` of `model_file` ("llama.py",
    "deepseek_v2.py" or a path under sglang/) on a stand-in last-PP-rank model.
    """
    rel = model_file if "/" in model_file else f"srt/models/{model_file}"
    rel = rel if rel.endswith(".py") else rel + ".py"
    owners = [n.name for n in SGLANG.parse(rel).body if isinstance(n, ast.ClassDef) and any(
        isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture" for f in n.body)]
    if len(owners) != 1:
        raise AssertionError(f"expected one class defining set_eagle3_layers_to_capture in sglang/{rel}, "
                             f"found {owners}")
    namespace = {"torch": torch, "Optional": Optional, "List": List}
    method = _compile_method(rel, owners[0], "set_eagle3_layers_to_capture", namespace)
    stand_in = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True),
        config=types.SimpleNamespace(num_hidden_layers=num_layers),
        model=types.SimpleNamespace(), capture_aux_hidden_states=False)
    method(stand_in, None if layer_ids is None else list(layer_ids))
    assert stand_in.capture_aux_hidden_states, f"{rel}: set_eagle3_layers_to_capture did not enable capture"
    return list(stand_in.model.layers_to_capture)


# ----------------------------------------------------------------------------- plugin hooks
HOOK_REGISTRY_FILE = "srt/plugins/hook_registry.py"
RESULT_PROCESSOR_FILE = "srt/managers/scheduler_components/batch_result_processor.py"
MANAGERS_UTILS_FILE = "srt/managers/utils.py"


def load_hook_registry() -> types.ModuleType:
    """The real sglang.srt.plugins.hook_registry module (it imports only the standard library), loaded
    from the installed source under its own dotted name. The caller puts it into sys.modules."""
    import importlib.util

    path = sglang_root() / HOOK_REGISTRY_FILE
    spec = importlib.util.spec_from_file_location("sglang.srt.plugins.hook_registry", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_append_prefill_hidden_states() -> types.FunctionType:
    """SchedulerBatchResultProcessor._append_prefill_hidden_states compiled from the real source."""
    return _compile_method(RESULT_PROCESSOR_FILE, "SchedulerBatchResultProcessor",
                           "_append_prefill_hidden_states", {})


def method_signature(rel_path: str, cls: str, name: str) -> tuple[list[str], list[str]]:
    """(positional parameter names, keyword-only parameter names) of a real method."""
    args = source_method(rel_path, cls, name).args
    return [a.arg for a in args.posonlyargs + args.args], [a.arg for a in args.kwonlyargs]


# ----------------------------------------------------------------------------- parameter shapes
def sglang_eagle3_shapes(config: dict) -> dict[tuple[str, object], tuple[int, ...]]:
    """{(parameter, shard id or None): the shape its weight loader takes} for LlamaForCausalLMEagle3 built on a
    drafter config.json (tensor parallel 1), with the sizes SGLang computes taken from the real statements:
    the input layer's qkv width (llama_eagle3.LlamaDecoderLayer), head_dim (llama.LlamaAttention) and fc's input
    width (llama_eagle3.LlamaModel: target_hidden_size x number of aux layers)."""
    c = types.SimpleNamespace(**config)
    h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    attn = _run_assignments(LLAMA_FILE, "LlamaAttention", "__init__", {"self.head_dim"},
                            {"config": c, "getattr": getattr,
                             "self": types.SimpleNamespace(hidden_size=h, total_num_heads=heads)})["self"]
    layer = _run_assignments(EAGLE3_FILE, "LlamaDecoderLayer", "__init__", {"hidden_size"},
                             {"self": types.SimpleNamespace(hidden_size=h, is_input_layer=True)})
    model = _run_assignments(EAGLE3_FILE, "LlamaModel", "__init__", {"self.hidden_size_in", "self.num_aux_hidden_states"},
                             {"config": c, "getattr": getattr, "hasattr": hasattr, "len": len,
                              "self": types.SimpleNamespace()})["self"]
    qkv_in, hd, inter = layer["hidden_size"], attn.head_dim, c.intermediate_size
    p = "model.layers.0."
    shapes = {("model.fc.weight", None): (h, model.hidden_size_in * model.num_aux_hidden_states),
              ("model.norm.weight", None): (h,), ("lm_head.weight", None): (c.draft_vocab_size, h),
              (p + "self_attn.qkv_proj.weight", "q"): (heads * hd, qkv_in),
              (p + "self_attn.qkv_proj.weight", "k"): (kv * hd, qkv_in),
              (p + "self_attn.qkv_proj.weight", "v"): (kv * hd, qkv_in),
              (p + "self_attn.o_proj.weight", None): (h, heads * hd),
              (p + "mlp.gate_up_proj.weight", 0): (inter, h), (p + "mlp.gate_up_proj.weight", 1): (inter, h),
              (p + "mlp.down_proj.weight", None): (h, inter)}
    shapes.update({(p + n, None): (h,) for n in ("input_layernorm.weight", "hidden_norm.weight",
                                                 "post_attention_layernorm.weight")})
    if sglang_norm_before_fc(config):
        shapes[("model.input_norm.weight", None)] = (model.hidden_size_in * model.num_aux_hidden_states,)
    if sglang_flags(config)["fc_norm"]:
        shapes.update({(f"model.fc_norm.{i}.weight", None): (model.hidden_size_in,)
                       for i in range(model.num_aux_hidden_states)})
    return shapes


def check_drafter_shapes(tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    """Tensors SGLang's real loader would hand to a parameter of another shape ([] = none), for the drafter
    config.json `config`: a misshapen weight fails the load on a GPU server, or worse, a view of it loads."""
    want = sglang_eagle3_shapes(config)
    calls = run_sglang_load_weights(tensors, norm_before_fc=sglang_norm_before_fc(config),
                                    fc_norm=sglang_flags(config)["fc_norm"])["calls"]
    return [f"{src} -> {param}[{shard}]: {shape}, SGLang builds {want.get((param, shard))}"
            for src, param, shard, shape in calls if want.get((param, shard)) != shape]


# ----------------------------------------------------------------------------- the MLA draft class
MLA_FILE = "srt/models/kimi_k25_eagle3.py"
DEEPSEEK_FILE = "srt/models/deepseek_v2.py"
MLA_CLASS = "Eagle3DeepseekV2ForCausalLM"
CONFIG_REGISTRY_FILE = "srt/utils/hf_transformers/common.py"
_MLA_REQUIRED_ATTRS = [
    (MLA_FILE, MLA_CLASS, {"model", "lm_head"}),
    (MLA_FILE, "Eagle3MLAModel", {"embed_tokens", "fc", "fc_norm", "midlayer", "norm"}),
    (MLA_FILE, "Eagle3MLADecoderLayer", {"self_attn", "mlp", "input_layernorm", "hidden_norm",
                                         "post_attention_layernorm"}),
    (DEEPSEEK_FILE, "DeepseekV2AttentionMLA", {"fused_qkv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj", "kv_b_proj",
                                               "kv_a_layernorm", "o_proj"}),
    (DEEPSEEK_FILE, "DeepseekV2MLP", {"gate_up_proj", "down_proj"}),
]


def sglang_mla_config(config: dict):
    """The config object SGLang 0.5.23 hands the MLA draft class for a drafter config.json: its registry maps
    model_type "kimi_k2" to an alias of transformers' DeepseekV3Config (checked in the source), built here with
    the installed transformers."""
    text = (sglang_root() / CONFIG_REGISTRY_FILE).read_text()
    if 'model_type = "kimi_k2"' not in text or '_CONFIG_REGISTRY["kimi_k2"] = _KimiK2ConfigAlias' not in text:
        raise AssertionError(f"sglang/{CONFIG_REGISTRY_FILE} no longer registers model_type kimi_k2")
    if config.get("model_type") != "kimi_k2":
        raise AssertionError(f"model_type {config.get('model_type')!r}: SGLang's registry would not read it as "
                             "DeepseekV3Config")
    from transformers import DeepseekV3Config

    return DeepseekV3Config.from_dict(config)


def _node_value(rel_path: str, cls: str, method: str, target: str) -> ast.expr:
    """The expression the real method first assigns to `target` (e.g. "self.q_b_proj", "is_neox_style"), a
    constructor call where one is assigned (lm_head: the untied branch's ParallelLMHead, not the tied alias)."""
    values = [node.value for node in ast.walk(source_method(rel_path, cls, method))
              if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets)]
    for value in sorted(values, key=lambda v: not isinstance(v, ast.Call)):
        return value
    raise AssertionError(f"{cls}.{method} in sglang/{rel_path} no longer assigns {target}")


def _eval(node: ast.expr, namespace: dict):
    return eval(compile(ast.Expression(node), "<sglang source>", "eval"), namespace)


def _built_shape(rel_path: str, cls: str, method: str, target: str, namespace: dict) -> tuple[int, ...]:
    """The weight shape of the layer the real method builds for `target`, from its constructor call's first two
    positional arguments: a *Linear(in, out) weighs [out, in], an RMSNorm(dim) [dim], a ParallelLMHead(vocab, dim)
    [vocab, dim]."""
    call = _node_value(rel_path, cls, method, target)
    name = ast.unparse(call.func)
    args = [_eval(a, namespace) for a in call.args[:2]]
    if name.endswith("Linear"):
        return args[1], args[0]
    if name == "RMSNorm":
        return (args[0],)
    if name == "ParallelLMHead":
        return args[0], args[1]
    raise AssertionError(f"{target} in sglang/{rel_path}: built by {name}, which this check does not know")


def sglang_mla_flags(config: dict) -> dict[str, bool]:
    """{"fc_norm", "norm_output", "rope_interleave"} as SGLang 0.5.23's MLA draft class switches them on for this
    drafter config.json: the real statements of Eagle3MLAModel.__init__ and DeepseekV2AttentionMLA.__init__ (its
    `is_neox_style`), run on the config SGLang builds."""
    c = sglang_mla_config(config)
    ns = _run_assignments(MLA_FILE, "Eagle3MLAModel", "__init__", {"use_fc_norm", "self.norm_output"},
                          {"config": c, "getattr": getattr, "self": types.SimpleNamespace()})
    neox = _eval(_node_value(DEEPSEEK_FILE, "DeepseekV2AttentionMLA", "__init__", "is_neox_style"),
                 {"config": c, "getattr": getattr})
    return {"fc_norm": bool(ns["use_fc_norm"]), "norm_output": bool(ns["self"].norm_output), "rope_interleave": not neox}


def sglang_mla_rope(config: dict) -> tuple[float, object]:
    """(rope_theta, rope_scaling) Eagle3MLADecoderLayer.__init__ passes to the MLA attention: its real if/else."""
    return tuple(_run_assignments(MLA_FILE, "Eagle3MLADecoderLayer", "__init__", {"rope_theta", "rope_scaling"},
                                  {"config": sglang_mla_config(config), "hasattr": hasattr})[k]
                 for k in ("rope_theta", "rope_scaling"))


def sglang_mla_shapes(config: dict) -> dict[tuple[str, object], tuple[int, ...]]:
    """{(parameter, shard id or None): shape} of Eagle3DeepseekV2ForCausalLM built on a drafter config.json
    (tensor parallel 1): every size from the real constructor calls, the MLA attention's arguments from the
    Eagle3MLADecoderLayer call that builds it. The MLP's two shards are gate/up of [intermediate, hidden]."""
    c = sglang_mla_config(config)
    missing = [f"{cls}.{attr} (sglang/{f})" for f, cls, attrs in _MLA_REQUIRED_ATTRS
               for attr in sorted(attrs - SGLANG.self_assigned(f, cls))]
    if missing:
        raise AssertionError(f"SGLang {SGLANG_VERSION} source lacks `self.<attr> = ...` for: {missing}")
    model_ns = {"config": c, "getattr": getattr, "self": types.SimpleNamespace(), "len": len,
                "_get_eagle_aux_layer_count": SGLANG.compile_function(MLA_FILE, None, "_get_eagle_aux_layer_count", {})}
    _run_assignments(MLA_FILE, "Eagle3MLAModel", "__init__", {"target_hidden_size", "self.num_aux_hidden_states"},
                     model_ns)
    n_aux, target_hidden = model_ns["self"].num_aux_hidden_states, model_ns["target_hidden_size"]
    call = _node_value(MLA_FILE, "Eagle3MLADecoderLayer", "__init__", "self.self_attn")
    kwargs = {k.arg: _eval(k.value, {"config": c}) for k in call.keywords
              if k.arg in ("hidden_size", "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                           "q_lora_rank", "kv_lora_rank")}
    attn = _run_assignments(DEEPSEEK_FILE, "DeepseekV2AttentionMLA", "__init__",
                            {"self.hidden_size", "self.qk_head_dim", "self.num_heads", "self.v_head_dim",
                             "self.q_lora_rank", "self.kv_lora_rank", "self.qk_nope_head_dim", "self.qk_rope_head_dim"},
                            {**kwargs, "self": types.SimpleNamespace()})["self"]
    attn_ns = {**kwargs, "self": attn, "config": c}
    p = "model.midlayer."
    shapes = {
        ("model.fc.weight", None): _built_shape(MLA_FILE, "Eagle3MLAModel", "__init__", "self.fc", model_ns),
        ("model.norm.weight", None): _built_shape(MLA_FILE, "Eagle3MLAModel", "__init__", "self.norm", model_ns),
        ("lm_head.weight", None): _built_shape(MLA_FILE, MLA_CLASS, "__init__", "self.lm_head",
                                               {"config": c, "draft_vocab_size": c.draft_vocab_size}),
        (p + "self_attn.fused_qkv_a_proj_with_mqa.weight", None): _built_shape(
            MLA_FILE, "Eagle3MLADecoderLayer", "__init__", "attn.fused_qkv_a_proj_with_mqa", {"config": c, "attn": attn}),
        (p + "mlp.gate_up_proj.weight", 0): (c.intermediate_size, c.hidden_size),
        (p + "mlp.gate_up_proj.weight", 1): (c.intermediate_size, c.hidden_size),
        (p + "mlp.down_proj.weight", None): (c.hidden_size, c.intermediate_size)}
    for name in ("q_a_layernorm", "q_b_proj", "kv_b_proj", "kv_a_layernorm", "o_proj"):
        shapes[(f"{p}self_attn.{name}.weight", None)] = _built_shape(DEEPSEEK_FILE, "DeepseekV2AttentionMLA", "__init__",
                                                                    f"self.{name}", attn_ns)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[(f"{p}{name}.weight", None)] = _built_shape(MLA_FILE, "Eagle3MLADecoderLayer", "__init__", f"self.{name}",
                                                          {"config": c})
    if sglang_mla_flags(config)["fc_norm"]:
        shapes.update({(f"model.fc_norm.{i}.weight", None): (target_hidden,) for i in range(n_aux)})
    return shapes


class _RecordingParam(_StandInParam):
    """A stand-in parameter that also keeps what it was loaded with (shard id -> tensor)."""

    def __init__(self, name: str, calls: list):
        super().__init__(name, calls)
        self.loaded: dict = {}

    def weight_loader(self, param, loaded_weight, shard_id=None):
        super().weight_loader(param, loaded_weight, shard_id)
        self.loaded[shard_id] = loaded_weight


def run_sglang_mla_load_weights(tensors: dict[str, torch.Tensor], config: dict) -> dict:
    """Run the real Eagle3DeepseekV2ForCausalLM.load_weights, then its post_load_weights (kv_b_proj split into the
    absorbed w_kc / w_vc), over `tensors` for the drafter config.json `config`. Returns {"calls": [(input names,
    param, shard id, shape)], "params": {param: _RecordingParam}, "ignored": [input names nothing loaded],
    "hot_token_id", "w_kc", "w_vc"}. Inputs the loader fuses (q_a_proj + kv_a_proj_with_mqa) share one call."""
    shapes = sglang_mla_shapes(config)
    calls: list = []

    class _Logger:
        @staticmethod
        def warning(*args):
            pass

    def default_weight_loader(param, loaded_weight):
        param.weight_loader(param, loaded_weight)

    namespace = {"torch": torch, "re": __import__("re"), "Iterable": Iterable, "Tuple": Tuple,
                 "default_weight_loader": default_weight_loader, "logger": _Logger}
    load_weights = _compile_method(MLA_FILE, MLA_CLASS, "load_weights", namespace)
    post_load = _compile_method(MLA_FILE, MLA_CLASS, "post_load_weights", {"torch": torch})
    params = {n: _RecordingParam(n, calls) for n in sorted({"model.embed_tokens.weight", *(k for k, _ in shapes)})}
    c = sglang_mla_config(config)
    kv_b = types.SimpleNamespace(weight=None)
    attn = types.SimpleNamespace(kv_b_proj=kv_b, qk_nope_head_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim)
    stand_in = types.SimpleNamespace(named_parameters=lambda: iter(params.items()), hot_token_id=None,
                                     model=types.SimpleNamespace(midlayer=types.SimpleNamespace(self_attn=attn)))
    stand_in.post_load_weights = lambda: None  # run below, once kv_b_proj's weight is in place
    per_input: dict[str, list] = {}

    def weights():
        for name, tensor in tensors.items():
            start = len(calls)
            yield name, tensor
            per_input[name] = calls[start:]

    load_weights(stand_in, weights())
    kv_b_name = "model.midlayer.self_attn.kv_b_proj.weight"
    if None in params[kv_b_name].loaded:
        kv_b.weight = params[kv_b_name].loaded[None].float()
        post_load(stand_in)
    fused = {n for n in tensors if "q_a_proj" in n or "kv_a_proj_with_mqa" in n}
    ignored = [n for n, got in per_input.items() if not got and "d2t" not in n and "t2d" not in n and n not in fused]
    if fused and not any("fused_qkv_a_proj_with_mqa" in p for p, *_ in calls):
        ignored += sorted(fused)
    records = [(name, *call) for name, got in per_input.items() for call in got]
    return {"calls": records, "params": params, "ignored": ignored, "hot_token_id": stand_in.hot_token_id,
            "w_kc": getattr(attn, "w_kc", None), "w_vc": getattr(attn, "w_vc", None), "shapes": shapes}


def check_mla_drafter(tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    """Problems SGLang 0.5.23's real MLA loader would hit with these tensors and this config.json ([] = none):
    names it drops, parameters it never loads (they stay random), shapes other than the ones it builds."""
    result = run_sglang_mla_load_weights(tensors, config)
    want = result["shapes"]
    problems = [f"{n}: ignored by SGLang's load_weights (no such parameter)" for n in result["ignored"]]
    loaded = {(param, shard) for _, param, shard, _ in result["calls"]}
    problems += [f"{p}[{s}]: never loaded (stays randomly initialised)" for p, s in sorted(want, key=str)
                 if (p, s) not in loaded]
    problems += [f"{src} -> {param}[{shard}]: {shape}, SGLang builds {want.get((param, shard))}"
                 for src, param, shard, shape in result["calls"] if want.get((param, shard)) != shape]
    if result["hot_token_id"] is None:
        problems.append("d2t missing: SGLang gets no hot_token_id (draft->target id map)")
    return problems


# ----------------------------------------------------------------------------- DFlash draft models
DFLASH_FILE = "srt/models/dflash.py"
DFLASH_UTILS_FILE = "srt/speculative/dflash_utils.py"


def sglang_dflash_utils() -> dict:
    """srt/speculative/dflash_utils.py's functions and classes (parse_dflash_draft_config and its helpers),
    compiled from the source; only its kernels' imports are stood in (never called here)."""
    import dataclasses
    import logging
    import typing
    from numbers import Integral

    ns = {"torch": torch, "dataclass": dataclasses.dataclass, "field": dataclasses.field, "Integral": Integral,
          "logger": logging.getLogger("sglang-dflash-utils"), **{n: getattr(typing, n) for n in (
              "Any", "List", "Optional", "Tuple")}, "Sequence": typing.Sequence}
    return SGLANG.compile_defs(DFLASH_UTILS_FILE, ns)


def build_sglang_dflash(config: dict):
    """SGLang 0.5.23's DFlashDraftModel for a draft config.json, built by its real constructors (dflash.py:
    DFlashDraftModel over DFlashDecoderLayer, DFlashAttention, DFlashMLP; the config parsed by the real
    parse_dflash_draft_config) on stand-in parallel layers, tensor parallel 1 -> (model, load record)."""
    import functools

    from transformers import Qwen3Config

    from tests.stand_in_layers import LoadRecord, SiluAndMul, stand_in_layers

    record = LoadRecord()
    utils = sglang_dflash_utils()

    def default_weight_loader(param, loaded, *_):
        assert param.size() == loaded.size(), f"loading {tuple(loaded.shape)} into {tuple(param.shape)}"
        param.data.copy_(loaded)
        record.copies.append(("<default>", None, loaded.data_ptr()))

    ns = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "partial": functools.partial,
          "Optional": Optional, "Iterable": Iterable, "Tuple": Tuple, "logger": utils["logger"], "_is_npu": False,
          "get_parallel": lambda: types.SimpleNamespace(tp_size=1, tp_rank=0),
          "get_rope": lambda *a, **k: torch.nn.Identity(), "RadixAttention": lambda *a, **k: torch.nn.Identity(),
          "get_rope_config": lambda c: (getattr(c, "rope_theta", 10000.0), getattr(c, "rope_scaling", None)),
          "AttentionType": types.SimpleNamespace(DECODER="decoder", ENCODER_ONLY="encoder_only"),
          "SiluAndMul": SiluAndMul, "set_weight_attrs": lambda *a, **k: None, "default_weight_loader": default_weight_loader,
          "get_compiler_backend": lambda: "inductor", "DraftParallelSpec": lambda **k: None,
          "DraftTPExecution": types.SimpleNamespace(SINGLE_GROUP=None), **utils}
    layers = stand_in_layers(record)
    ns.update(layers, GemmaRMSNorm=layers["RMSNorm"], ColumnParallelLinear=layers["RowParallelLinear"])
    SGLANG.compile_defs(DFLASH_FILE, ns)
    return ns["DFlashDraftModel"](Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})), record


def check_sglang_dflash_load(model, record, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems of the real DFlashDraftModel.load_weights with `tensors` ([] = none): it drops unknown names without
    a word, so none may be unknown; no parameter may stay unloaded."""
    from tests.stand_in_layers import load_problems

    return load_problems(model, record, tensors, "SGLang")
