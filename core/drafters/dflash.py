"""DFlash: a block drafter (block diffusion drafting), the second drafter family beside EAGLE-3.

One forward of a few Qwen3-style layers drafts a whole block: the last accepted token (the anchor) followed by
mask tokens, every row attending to the target's context features and to every other row of the block (not
causal). The context features are the target's aux hidden states of the positions before the anchor, fused
once per position and projected into each layer's K/V, as llama.cpp b11434 (`src/models/dflash.cpp`,
`common/speculative.cpp`) and SGLang 0.5.23 (`srt/models/dflash.py`) run it; the embedding and the LM head
are the target's own (neither is in the checkpoint).

    ctx    = hidden_norm(fc(aux))                               # [C, H]: one row per context position
    x      = embed([anchor, mask, ..., mask])                   # [Q, H]: the block, at positions p .. p+Q-1
    layer:   h = input_layernorm(x)
             q = rope(q_norm(q_proj(h)))                        # per-head RMSNorm over head_dim, then RoPE
             k = rope(k_norm(k_proj([ctx; h])))                 # the context rows at their own positions
             v = v_proj([ctx; h])
             x = x + o_proj(attn(q, k, v))                      # block rows see all of ctx and all of the block
             x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                                   # slot j (1..Q-1) predicts the token at p + j

Layer ids: the checkpoint's `dflash_config.target_layer_ids` count layer OUTPUTS (i = hidden_states[i+1]), so
our input-of-layer aux ids k are written as k - 1; llama.cpp's converter and vLLM add the 1 back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from core.drafters.drafter import MLP, RMSNorm, apply_rope, write_weights
from core.drafters.drafter_config import target_layer_shape
from core.engine.decode import Generation, new_cache, prefill, verify
from core.engine.speculative import accept_chain, emitted_tokens
from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_json

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    block_size: int
    mask_token_id: int
    aux_layers: list[int] = field(default_factory=list)  # input-of-layer convention
    target_model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @classmethod
    def for_target(cls, tc: dict, aux_layers: list[int], layers: int, block_size: int, mask_token_id: int) -> DFlashConfig:
        """The drafter train builds for a target (core.target.model.read_target_config): its width, heads and MLP."""
        if not 0 <= mask_token_id < tc["vocab_size"]:
            raise UserError(f"train.dflash.mask_token_id = {mask_token_id}: outside the target's vocab of "
                            f"{tc['vocab_size']}")
        shape = target_layer_shape(tc)
        return cls(**shape, num_hidden_layers=layers, vocab_size=tc["vocab_size"],
                   target_hidden_size=shape["hidden_size"], target_num_layers=tc["num_hidden_layers"],
                   block_size=block_size, mask_token_id=mask_token_id, aux_layers=list(aux_layers),
                   target_model_type=tc["model_type"], rms_norm_eps=tc.get("rms_norm_eps", 1e-6))

    def to_hf(self) -> dict:
        """config.json as llama.cpp's converter (DFlashModel) and SGLang's DFlashDraftModel read it."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "dflash_config": {"target_layer_ids": [k - 1 for k in self.aux_layers], "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size, "num_target_layers": self.target_num_layers},
            "eagle3_training": {"aux_layers_input_convention": self.aux_layers,
                                "target_model_type": self.target_model_type},
        }

    def speculators_refusal(self) -> str:
        """Why no speculators-format copy is written (train's Exporter asks every drafter config)."""
        return "a DFlash drafter (vLLM and SGLang read drafter/ as DFlashDraftModel)"

    @classmethod
    def from_hf(cls, cfg: dict, target_model_type: str, target_num_layers: int) -> DFlashConfig:
        if cfg.get("architectures") != [ARCHITECTURE]:
            raise UserError(f"drafter config.json: architectures = {cfg.get('architectures')}, expected ['{ARCHITECTURE}']")
        d = cfg.get("dflash_config") or {}
        if cfg.get("causal") or d.get("causal"):
            raise UserError("drafter config.json: a causal DFlash block; this project's drafter attends across it")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        return cls(hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
                   num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads, num_hidden_layers=cfg["num_hidden_layers"],
                   vocab_size=cfg["vocab_size"], target_hidden_size=hidden, target_num_layers=target_num_layers,
                   block_size=d.get("block_size", cfg.get("block_size", 16)), mask_token_id=d["mask_token_id"],
                   aux_layers=[i + 1 for i in d["target_layer_ids"]], target_model_type=target_model_type,
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                   rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                   max_position_embeddings=cfg.get("max_position_embeddings", 4096))


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,T,H] (context features, or the block's normed rows) at positions [B,T] -> k, v [B,nkv,T,d]."""
        c, (b, t) = self.c, x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rope(k, positions, c.rope_theta), v

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """The block's rows h [B,Q,H] attend to the context's K/V [B,nkv,C,d] and to each other; mask [B|1,1,Q,C+Q]
        (True = visible) or None (all visible)."""
        c, (b, q_len) = self.c, h.shape[:2]
        q = self.q_norm(self.q_proj(h).view(b, q_len, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        q = apply_rope(q, positions, c.rope_theta)
        k, v = self.kv(h, positions)
        k, v = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, positions, ctx_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The trained weights (fc, hidden_norm, layers, norm) and the target's embedding and LM head (frozen
    buffers: neither is exported)."""

    def __init__(self, c: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)
        # training's per-feature preconditioner of fc's input (core/drafters/drafter.py's docstring), folded into fc at export
        self.register_buffer("aux_scale", torch.ones(len(c.aux_layers) * c.target_hidden_size))

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,C,n·Ht] (the target's aux states) -> the fused context features [B,C,H]."""
        return self.hidden_norm(self.fc(aux / self.aux_scale))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V of the context rows [B,C,H] at positions [B,C]."""
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, ctx_kv, mask=None) -> torch.Tensor:
        """Block rows (tokens [B,Q] at positions [B,Q]) over the context K/V -> the normed states [B,Q,H] the LM head
        reads (training sends it only the rows it counts)."""
        x = self.embed[tokens]
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, positions, kv, mask)
        return self.norm(x)

    def block_logits(self, tokens: torch.Tensor, positions: torch.Tensor, ctx_kv, mask=None) -> torch.Tensor:
        """-> logits [B,Q,V] of every block row."""
        return F.linear(self.block_hidden(tokens, positions, ctx_kv, mask), self.lm_head)

    # ---- checkpoint (llama.cpp's DFlashModel converter, SGLang's DFlashDraftModel) -------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().cpu().float() for k, v in self.state_dict().items() if k != "aux_scale"}
        sd["fc.weight"] = sd["fc.weight"] / self.aux_scale.cpu()
        return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}

    def save_pretrained(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        write_weights(out_dir, self.export_state_dict())
        atomic_write_json(out_dir / "config.json", self.config.to_hf())
        atomic_write_json(out_dir / "dflash_drafter.json", asdict(self.config))

    @classmethod
    def from_pretrained(cls, in_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor, target_model_type: str,
                        target_num_layers: int) -> DFlashDrafter:
        in_dir = Path(in_dir)
        try:
            c = DFlashConfig.from_hf(json.loads((in_dir / "config.json").read_text()), target_model_type,
                                     target_num_layers)
            weights = load_file(str(in_dir / "model.safetensors"))
        except (OSError, json.JSONDecodeError, SafetensorError, KeyError, TypeError) as e:
            raise UserError(f"{in_dir}: not a DFlash drafter dir ({type(e).__name__}: {e})") from None
        if (c.vocab_size, c.target_hidden_size) != tuple(embed.shape):
            raise UserError(f"{in_dir}: DFlash drafter for a target of vocab {c.vocab_size} / hidden size "
                            f"{c.target_hidden_size}, but this target has {tuple(embed.shape)}")
        model = cls(c, embed, lm_head)
        weights = {k.removeprefix("model."): v.float() for k, v in weights.items()}
        weights["aux_scale"] = torch.ones(len(c.aux_layers) * c.target_hidden_size)
        try:
            missing, unexpected = model.load_state_dict(weights, strict=False)
        except RuntimeError as e:
            raise UserError(f"{in_dir}: weights do not fit its config.json: {str(e).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise UserError(f"{in_dir}: missing {missing}, unexpected {unexpected}")
        return model


def is_dflash_dir(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("architectures") == [ARCHITECTURE]
    except (OSError, json.JSONDecodeError):
        return False


# ---- decoding (our engine): one block per verification, lossless against greedy -------------------------------
class ContextCache:
    """Each layer's K/V of the context positions [0, length): appended as the target accepts tokens."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter, self.kv, self.length = drafter, None, 0

    def append(self, aux: torch.Tensor) -> None:
        """aux [1,n,·] of the next n positions (the target's aux states of accepted tokens)."""
        n = aux.shape[1]
        positions = torch.arange(self.length, self.length + n, device=aux.device)[None]
        new = self.drafter.context_kv(self.drafter.context(aux.to(self.drafter.fc.weight.dtype)), positions)
        self.kv = new if self.kv is None else [(torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                                               for (k0, v0), (k, v) in zip(self.kv, new, strict=True)]
        self.length += n


def draft_block(drafter: DFlashDrafter, anchor: int, ctx: ContextCache, steps: int) -> torch.Tensor:
    """The block [anchor, mask x steps] at positions ctx.length.. (the anchor's own) -> logits [steps, V], slot j
    predicting the token j after the anchor (llama.cpp's block is as long: anchor + n_max masks)."""
    c, device = drafter.config, drafter.fc.weight.device
    tokens = torch.tensor([[anchor] + [c.mask_token_id] * steps], device=device)
    positions = torch.arange(ctx.length, ctx.length + steps + 1, device=device)[None]
    return drafter.block_logits(tokens, positions, ctx.kv)[0, 1:]


@torch.inference_mode()
def dflash_generate(model, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
                    steps: int) -> Generation:
    """Speculative decoding with a DFlash drafter, greedy (the output equals `generate`'s): each round drafts
    one block of `steps` tokens (at most block_size - 1), the target verifies them in one forward and keeps
    what it agrees with plus its own next token; the accepted positions' aux states join the context."""
    if not 1 <= steps <= drafter.config.block_size - 1:
        raise ValueError(f"draft steps {steps}: a DFlash block of {drafter.config.block_size} drafts 1 .. "
                         f"{drafter.config.block_size - 1}")
    aux_layers = drafter.config.aux_layers
    cache = new_cache(model, len(prompt) + max_new_tokens + steps + 1)
    logits, aux = prefill(model, cache, torch.tensor([prompt], device=model.device), aux_layers=aux_layers)
    out, m = [int(logits[0].argmax())], len(prompt)  # out[-1] sits at position m, not yet run by the target
    ctx = ContextCache(drafter)
    ctx.append(aux)
    accept_lengths, drafted = [], []
    while out[-1] not in stop_ids and len(out) < max_new_tokens:
        drafts = draft_block(drafter, out[-1], ctx, steps).argmax(-1).tolist()[: max(0, max_new_tokens - len(out) - 1)]
        logits, aux = verify(model, cache, [out[-1], *drafts], m, aux_layers)
        a, nxt = accept_chain(drafts, logits.argmax(-1).tolist())
        new = emitted_tokens(drafts[:a] + [nxt], stop_ids, max_new_tokens - len(out))
        accept_lengths.append(len(new))
        drafted.append(len(drafts))
        out += new
        ctx.append(aux[:, : len(new)])  # the anchor and the accepted drafts: positions m .. m + len(new) - 1
        m += len(new)
    return Generation(out, "stop" if out[-1] in stop_ids else "length", accept_lengths, drafted)
