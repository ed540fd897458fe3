"""A drafter's config.json: the fields SGLang (LlamaForCausalLMEagle3), vLLM and llama.cpp's converter read,
written by `DrafterConfig.to_sglang` and read back by `from_sglang`. The engines disagree on what aux layer
ids mean (core/target/aux_layers.py) and on where `norm_before_fc` lives, so the config writes each engine's key and
refuses a file whose keys would make two engines serve different models.

An MLA drafter (`mla` set) is SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM (srt/models/kimi_k25_eagle3.py): the
same EAGLE-3 layout with DeepSeek-V2 multi-latent attention, config.json of model_type `kimi_k2` (SGLang's config
registry reads it as transformers' DeepseekV3Config), so its draft KV cache per token is one latent of
kv_lora_rank + qk_rope_head_dim, the target's MLA shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from core.run.errors import UserError
from core.target.aux_layers import aux_layers_from_sglang, sglang_layer_ids


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek-V2 multi-latent attention sizes of an MLA draft layer (the names DeepseekV3Config uses)."""
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def for_target(cls, tc: dict, requested: dict[str, int]) -> MLAShape:
        """The sizes train builds: `requested` (train.mla; 0 = unset) over the target's own when it is MLA
        (Kimi-K2.5: 1536 / 512 / 128 / 64 / 128), else DeepSeek-V3's proportions to the target's head dim d:
        kv_lora_rank 4d, q_lora_rank 12d (at most the hidden size), nope = v = d, rope d/2."""
        d = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
        own = {"q_lora_rank": min(12 * d, tc["hidden_size"]), "kv_lora_rank": 4 * d, "qk_nope_head_dim": d,
               "qk_rope_head_dim": d // 2, "v_head_dim": d}
        if tc.get("kv_lora_rank"):
            own = {k: tc.get(k) or own[k] for k in own}
        shape = cls(**{k: requested.get(k) or v for k, v in own.items()})
        if shape.qk_rope_head_dim % 2:
            raise UserError(f"train.mla.qk_rope_head_dim = {shape.qk_rope_head_dim}: RoPE rotates pairs, it must be even")
        return shape


class DraftVariant(NamedTuple):
    """Which drafter train builds beyond the target's shape: EAGLE-3.1's three norms and the draft attention
    (mla: the MLAShape of an MLA layer, None for Llama GQA)."""
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    mla: MLAShape | None = None

    @classmethod
    def of(cls, tc: dict, train) -> DraftVariant:
        """The variant a run's `train` section (core.run.config.TrainConfig) asks for on the target `tc`."""
        mla = MLAShape.for_target(tc, asdict(train.mla)) if train.draft_attention == "mla" else None
        return cls(train.norm_before_fc, train.fc_norm, train.norm_output, mla)


PLAIN_EAGLE3 = DraftVariant()


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)  # input-of-layer convention
    target_model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_fc: bool = False  # EAGLE-3.1: input_norm over the [3Ht] aux before fc
    fc_norm: bool = False  # EAGLE-3.1: fc_norm.{0,1,2}, an RMSNorm over each [Ht] aux chunk before fc
    norm_output: bool = False  # EAGLE-3.1: a step after the first reads norm(h2), not h2
    mla: MLAShape | None = None  # an MLA draft layer (Eagle3DeepseekV2ForCausalLM), else Llama GQA

    def __post_init__(self):
        if self.mla is not None and self.norm_before_fc:
            raise UserError("norm_before_fc with an MLA draft layer: SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM has "
                            "no input_norm (it reads fc_norm and norm_output): use train.fc_norm, or draft_attention gqa")

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: nope + rope for MLA, head_dim for GQA (the attention's softmax scale)."""
        return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kernel_head_dim(self) -> int:
        """The head dim a fused attention kernel runs at: q/k and v widened to the wider of the two (MLA's v heads
        are narrower; train/ttt_attention.py pads them with zeros)."""
        return max(self.qk_head_dim, self.mla.v_head_dim) if self.mla else self.head_dim

    @classmethod
    def for_target(cls, tc: dict, aux_layers: list[int], draft_vocab_size: int,
                   variant: DraftVariant = PLAIN_EAGLE3) -> DrafterConfig:
        """The drafter train builds for a target: one layer of the target's width, heads and MLP (tc =
        core.target.model.read_target_config: a MoE target's dense MLP width), Llama GQA or MLA."""
        shape = target_layer_shape(tc)
        return cls(
            **shape, vocab_size=tc["vocab_size"], draft_vocab_size=draft_vocab_size,
            target_hidden_size=shape["hidden_size"], aux_layers=list(aux_layers), target_model_type=tc["model_type"],
            rms_norm_eps=tc.get("rms_norm_eps", 1e-5), hidden_act=tc.get("hidden_act", "silu"),
            norm_before_fc=variant.norm_before_fc, fc_norm=variant.fc_norm, norm_output=variant.norm_output,
            mla=variant.mla)

    def to_sglang(self) -> dict:
        """config.json SGLang (LlamaForCausalLMEagle3, or Eagle3DeepseekV2ForCausalLM for MLA) and vLLM read."""
        ids = sglang_layer_ids(self.aux_layers, self.target_model_type)
        if self.mla:  # rope_interleave: DeepSeek's pairwise RoPE, which SGLang's MLA uses unless told otherwise
            arch = {"architectures": [MLA_ARCHITECTURE], "model_type": "kimi_k2", **self.mla.__dict__,
                    "rope_interleave": True}
        else:
            arch = {"architectures": [GQA_ARCHITECTURE], "model_type": "llama", "head_dim": self.head_dim}
        cfg = {
            **arch, "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": self.hidden_act,
            "rope_theta": self.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            # llama.cpp's converter reads only this top-level key and uses it as input-of-layer ids (our
            # convention); SGLang captures from eagle_config and reads this key only to count layers
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            # ours, for tools that read the input-of-layer convention (vLLM speculators: unshifted)
            "eagle3_training": {"aux_layers_input_convention": self.aux_layers,
                                "target_model_type": self.target_model_type},
        }
        if self.target_hidden_size != self.hidden_size:
            cfg["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_fc:  # top level: SGLang reads it there (or in eagle_config), llama.cpp only there
            cfg["norm_before_fc"] = True
        for flag in ("fc_norm", "norm_output"):  # top level, where SGLang 0.5.23 reads them
            if getattr(self, flag):
                cfg[flag] = True
        return cfg

    def speculators_refusal(self) -> str | None:
        """Why the speculators format cannot hold this drafter (None: it can)."""
        if self.mla:
            return ("an MLA draft layer: speculators 0.9's eagle3 format and vLLM 0.33's reader of it build a Llama "
                    "or Qwen3 layer only (vLLM serves this drafter from drafter/, Eagle3DeepseekV2ForCausalLM)")
        if self.norm_before_fc and self.fc_norm:
            return "norm_before_fc with fc_norm: speculators 0.9's Eagle3SpeculatorConfig refuses the two together"
        return None

    def to_speculators(self, verifier: Verifier, speculative_tokens: int) -> dict:
        """config.json in speculators 0.9's EAGLE-3 format, which `vllm serve <dir>` reads alone (vLLM 0.33
        transformers_utils/configs/speculators). Every flag vLLM would otherwise default is spelled out: there an
        absent norm_before_residual means true, another layer than ours."""
        why = self.speculators_refusal()
        if why:
            raise UserError(f"no speculators-format export for {why}")
        hf = self.to_sglang()
        layer = {k: hf[k] for k in _LAYER_KEYS}
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)}},
            "transformer_layer_config": {**layer, "model_type": "llama", "dtype": "bfloat16"},
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": False, "norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),  # vLLM's ids are input-of-layer, as ours
            "eagle3_training": hf["eagle3_training"],
        }

    @classmethod
    def from_speculators(cls, cfg: dict, target_model_type: str) -> DrafterConfig:
        """A speculators-format EAGLE-3 config.json (ours, or one speculators trained) read as vLLM 0.33 reads it."""
        if cfg.get("speculators_model_type") != "eagle3":
            raise UserError(f"drafter config.json: speculators_model_type = {cfg.get('speculators_model_type')!r}, "
                            "expected 'eagle3'")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UserError("drafter config.json: speculators format without a transformer_layer_config mapping")
        if layer.get("model_type", "llama") != "llama":
            raise UserError(f"drafter config.json: transformer_layer_config.model_type = {layer['model_type']!r}: "
                            "this project's drafter is a Llama layer")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if not ids:  # vLLM would capture its own default layers, not those the drafter was trained on
            raise UserError("drafter config.json: no eagle_aux_hidden_state_layer_ids: the target layers this "
                            "drafter reads are unknown")
        hf = {**layer, "architectures": [GQA_ARCHITECTURE], "eagle_aux_hidden_state_layer_ids": list(ids),
              # absent = true in vLLM 0.33's update_eagle3: refused as a variant we do not implement
              "norm_before_residual": cfg.get("norm_before_residual", True),
              **{k: cfg[k] for k in ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm",
                                     "norm_output") if cfg.get(k) is not None}}
        return cls.from_sglang(hf, target_model_type, 0)

    @classmethod
    def from_sglang(cls, cfg: dict, target_model_type: str, target_num_layers: int) -> DrafterConfig:
        arch = cfg.get("architectures")
        if arch not in ([GQA_ARCHITECTURE], [MLA_ARCHITECTURE]):
            raise UserError(f"drafter config.json: architectures = {arch}, expected ['{GQA_ARCHITECTURE}'] or "
                            f"['{MLA_ARCHITECTURE}']")
        mla = MLAShape(**{k: cfg[k] for k in MLAShape.__dataclass_fields__}) if arch == [MLA_ARCHITECTURE] else None
        if mla and not cfg.get("rope_interleave", True):
            raise UserError("drafter config.json: rope_interleave = false (Neox-style RoPE in an MLA drafter): this "
                            "project's MLA drafter rotates DeepSeek's interleaved pairs")
        if cfg.get("tie_word_embeddings"):
            raise UserError("drafter config.json: tie_word_embeddings must be false")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = cfg.get("eagle_aux_hidden_state_layer_ids")  # input-of-layer ids (llama.cpp, vLLM)
        aux_layers = aux_layers_from_sglang(ids, target_model_type, target_num_layers) if ids or not top else top
        if top and list(top) != aux_layers:
            raise UserError(f"drafter config.json: eagle_aux_hidden_state_layer_ids = {top} (input of layer) but "
                             f"eagle_config's SGLang ids {ids} capture {aux_layers} on a {target_model_type} "
                             "target: the engines would feed the drafter different layers")
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or {}
        norm_before_fc = read_norm_before_fc(cfg)
        return cls(
            hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or hidden // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", hidden),
            aux_layers=aux_layers,
            target_model_type=target_model_type, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            hidden_act=cfg.get("hidden_act", "silu"), norm_before_fc=norm_before_fc,
            fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")), norm_output=bool(cfg.get("norm_output")),
            mla=mla)


def target_layer_shape(tc: dict) -> dict:
    """A draft layer of the target's own shape (core.target.model.read_target_config: a MoE target's dense MLP width):
    width, MLP, heads, head dim, RoPE base and context, as both drafter families build it."""
    hidden, heads = tc["hidden_size"], tc["num_attention_heads"]
    rope = tc.get("rope_parameters") or {}
    return {"hidden_size": hidden, "intermediate_size": tc["intermediate_size"], "num_attention_heads": heads,
            "num_key_value_heads": tc.get("num_key_value_heads") or heads,
            "head_dim": tc.get("head_dim") or hidden // heads,  # MLA targets (Kimi) have none: 7168 / 64 = 112
            "rope_theta": float(rope.get("rope_theta") or tc.get("rope_theta") or 10000.0),
            "max_position_embeddings": tc.get("max_position_embeddings", 4096)}


class Verifier(NamedTuple):
    """The target a speculators-format drafter names: its Hub repo id (None when unknown: vLLM then takes the
    target from --model) and the architectures of its config.json."""
    name_or_path: str | None
    architectures: list[str]


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format to_speculators writes
# The Llama layer keys of to_sglang's config.json that speculators' transformer_layer_config carries
_LAYER_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "hidden_act", "rope_theta", "rope_parameters", "max_position_embeddings",
               "vocab_size", "tie_word_embeddings")
GQA_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


# Variants SGLang 0.5.23 switches on from config.json that our drafter does not implement: loading such a
# drafter into our engine would silently evaluate another model, so it is refused.
_UNSUPPORTED_FLAGS = ("norm_before_residual",)


def read_norm_before_fc(cfg: dict) -> bool:
    """norm_before_fc as the engines read it: SGLang takes eagle_config's key, else the top-level one;
    llama.cpp's converter only the top-level one. A config where they disagree means two models."""
    unsupported = [k for k in _UNSUPPORTED_FLAGS if cfg.get(k)]
    if unsupported:
        raise UserError(f"drafter config.json sets {unsupported}: an EAGLE-3 variant this project's drafter "
                        "does not implement (norm_before_fc, fc_norm and norm_output are)")
    nested = (cfg.get("eagle_config") or {}).get("norm_before_fc")
    top = cfg.get("norm_before_fc")
    if nested is not None and bool(nested) != bool(top):
        raise UserError(f"drafter config.json: eagle_config.norm_before_fc = {nested} but the top-level "
                        f"norm_before_fc = {top}: SGLang reads the first, llama.cpp only the second, so the "
                        "engines would serve different models; set both to the same value")
    return bool(top)
