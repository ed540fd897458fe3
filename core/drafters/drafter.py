"""The EAGLE-3 drafter, with module names equal to what SGLang's LlamaForCausalLMEagle3 (GQA) or
Eagle3DeepseekV2ForCausalLM (MLA) loads.

Shapes: B batch, T tokens, H draft hidden (= target hidden), Ht target hidden, V target vocab,
Vd draft vocab, nh/nkv heads, d head dim.

    g        = fc(aux)                                   # [B,T,3Ht] -> [B,T,H]; first step only
             = fc(input_norm(aux))                       # with norm_before_fc (EAGLE-3.1)
             = fc(cat(fc_norm[i](aux_i)))                # with fc_norm (EAGLE-3.1): each [Ht] chunk its own norm
    x        = cat(input_layernorm(embed(tok)), hidden_norm(g))       # [B,T,2H]
    h        = g + o_proj(attn(q, k, v of x))
    h2       = h + mlp(post_attention_layernorm(h))      # pre-norm output: the next step's input
    logits   = lm_head(norm(h2))                         # [B,T,Vd]; with norm_output (EAGLE-3.1) the next
                                                         # step's input is norm(h2)

`aux_scale` is a fixed per-feature preconditioner for training only: target residual streams carry
"massive activation" features (SmolLM2: RMS ~350 beside ~1), and with Adam's uniform step size
fc's columns for them would move ~350x faster than the rest (no ablation measured yet). Training sees
fc(x / aux_scale), x = fc's input (aux, or input_norm(aux) with norm_before_fc); the export folds the
scale into fc.weight (fc(x / s) = (W / s) x for any x), so the checkpoint has plain engine numerics.
The scale sits after the norm, never before it: norm(aux / s) != norm(aux) / s for a per-feature s,
so a scale inside the norm could not be folded into any exported weight.

`norm_before_fc` (EAGLE-3.1): an RMSNorm over the concatenated [3Ht] aux, weight `input_norm.weight`,
eps rms_norm_eps; the names SGLang 0.5.23 (`model.input_norm`) and llama.cpp b11434's converter
(`input_norm.weight` -> `enc.output_norm.weight`) load, both switched on by config.json's top-level
`norm_before_fc`. `fc_norm` and `norm_output` (EAGLE-3.1, both off by default) are the config.json keys SGLang
0.5.23's LlamaForCausalLMEagle3 reads (weights `fc_norm.{0,1,2}.weight`); llama.cpp b11434's converter reads
neither, so its export refuses a drafter with either.

Attention is left to the caller (`qkv` / `finish`), because training (TTT diagonal mask,
train/ttt_loss.py) and decoding (KV cache, `forward` below) attend differently. Its input projections read x
(`in_projs`: GQA's q/k/v, MLA's q_a / kv_a down-projections) and `heads` turns them into q, k, v: the same q, k,
v whether the layer is GQA (`Attention`) or MLA (`MLAAttention`, DeepSeek-V2 as SGLang's Eagle3MLADecoderLayer
builds it: its down-projections read the [2H] x, keys are [k_nope, k_rope] with one RoPE key shared by all heads).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from core.drafters.drafter_config import DrafterConfig, Verifier
from core.run.errors import UserError
from core.storage.atomic_io import atomic_write, atomic_write_json

# SGLang and eval take the embedding from the target; aux_scale is folded into fc.weight.
EXPORT_EXCLUDE = ("embed_tokens.weight", "aux_scale")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool = False) -> torch.Tensor:
    """RoPE over x [B,n,T,d], positions [B,T]: Llama's rotate-half (pairs i, i + d/2), or DeepSeek's interleaved
    pairs (2i, 2i+1; SGLang's is_neox_style=False), each pair i turned by positions x theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None, :, None] * inv_freq  # [B,1,T,d/2]
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return (torch.stack(out, -1).flatten(-2) if interleaved else torch.cat(out, -1)).to(x.dtype)


class Attention(nn.Module):
    """Llama GQA over the [2H] input."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def in_projs(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def heads(self, projected: tuple[torch.Tensor, ...], positions: torch.Tensor):
        """in_projs' outputs [B,T,*] -> q [B,nh,T,d], k/v [B,nkv,T,d], RoPE applied."""
        c, (q, k, v) = self.c, projected
        b, t = q.shape[:2]
        q = q.view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # explicit heads: t may be 0
        k, v = (y.view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2) for y in (k, v))
        return apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta), v


class MLAAttention(nn.Module):
    """DeepSeek-V2 multi-latent attention over the [2H] input, with the module names SGLang 0.5.23's
    Eagle3DeepseekV2ForCausalLM loads (it fuses q_a_proj and kv_a_proj_with_mqa, in that order, into one GEMM).

        q        = q_b_proj(q_a_layernorm(q_a_proj(x)))                  # [B,T,nh,nope+rope]
        c, k_pe  = kv_a_proj_with_mqa(x).split(kv_lora_rank, rope)        # the latent SGLang caches, and one
        k_nope, v = kv_b_proj(kv_a_layernorm(c)).split(nope, v)          # RoPE key shared by every head
        q, k     = [q_nope, rope(q_pe)], [k_nope, rope(k_pe)]            # scores scaled by (nope + rope)^-0.5
    """

    def __init__(self, c: DrafterConfig):
        super().__init__()
        m, nh, eps = c.mla, c.num_attention_heads, c.rms_norm_eps
        self.c = c
        self.q_a_proj = nn.Linear(2 * c.hidden_size, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(m.q_lora_rank, nh * (m.qk_nope_head_dim + m.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * m.v_head_dim, c.hidden_size, bias=False)

    def in_projs(self) -> tuple[nn.Linear, ...]:
        return self.q_a_proj, self.kv_a_proj_with_mqa

    def heads(self, projected: tuple[torch.Tensor, ...], positions: torch.Tensor):
        """in_projs' outputs -> q, k [B,nh,T,nope+rope], v [B,nh,T,v_head_dim], RoPE applied to the rope parts."""
        m, nh, theta = self.c.mla, self.c.num_attention_heads, self.c.rope_theta
        q_a, kv_a = projected
        b, t = q_a.shape[:2]
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(b, t, nh, self.c.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, nh, m.qk_nope_head_dim + m.v_head_dim)
        kv = kv.transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
        k_pe = apply_rope(k_pe[:, None], positions, theta, interleaved=True)  # [B,1,T,rope]
        q = torch.cat([q_nope, apply_rope(q_pe, positions, theta, interleaved=True)], -1)
        return q, torch.cat([k_nope, k_pe.expand(b, nh, t, -1)], -1), v


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c) if c.mla else Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class DraftCache:
    """The drafter's static KV cache: K/V buffers for `max_len` positions, allocated at the first
    append; positions [0, length) are valid. Drafting appends past `length`; `rollback(n)` forgets
    the positions from n on (rejected drafts) and the next append overwrites their slots. Shapes never
    change (attention runs over the whole buffer under a mask), which a compiled step needs."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None):
        """k/v [B,nkv,T,d] at slots length.. -> (all keys, all values, mask [T,max_len]). The mask is
        causal over the slots unless `visible` [T,max_len] says which slots each new row sees (a tree)."""
        start, t = self.length, k.shape[2]
        if start + t > self.max_len:
            raise ValueError(f"draft cache full: {start} + {t} positions > max_len {self.max_len}")
        if self.k is None:  # v's own head dim: an MLA layer's v heads are narrower than its keys
            self.k = k.new_zeros(k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.v = v.new_zeros(v.shape[0], v.shape[1], self.max_len, v.shape[3])
        self.k[:, :, start:start + t] = k
        self.v[:, :, start:start + t] = v
        self.length = start + t
        if visible is not None:
            return self.k, self.v, visible
        slots = torch.arange(self.max_len, device=k.device)
        mask = slots[None, :] <= torch.arange(start, start + t, device=k.device)[:, None]
        return self.k, self.v, mask

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.requires_grad_(False)  # the target's embedding, frozen
        # EAGLE-3.1 only; absent otherwise, so a plain drafter exports no tensor an engine won't load
        self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3)) if c.fc_norm else None
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.register_buffer("aux_scale", torch.ones(3 * c.target_hidden_size))

    def token_qkv(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B,T] -> the attention input projections' token half (GQA: q, k, v; MLA: q_a, kv_a), each [B,T,*]: the
        half of the attention input with neither a position nor a hidden state in it. TTT computes it once for
        all K steps (step k's token at t is step 0's at t+k), not once per step: of each step's input GEMMs,
        forward and backward, that is half the FLOPs (`qkv(..., token_qkv=...)`)."""
        x, h = self.midlayer.input_layernorm(self.embed_tokens(tokens)), self.config.hidden_size
        return tuple(F.linear(x, proj.weight[:, :h]) for proj in self.midlayer.self_attn.in_projs())

    def qkv(self, hidden: torch.Tensor, tokens: torch.Tensor | None, positions: torch.Tensor,
            token_qkv: tuple[torch.Tensor, ...] | None = None):
        """hidden [B,T,3Ht] (target aux: step 0) or [B,T,H] (previous step's h2); tokens [B,T], or their
        `token_qkv` computed already (then tokens are not read).
        Returns q [B,nh,T,d], k/v [B,nkv,T,d] (RoPE applied; MLA: nkv = nh, v of v_head_dim) and the residual
        [B,T,H]."""
        c, layer = self.config, self.midlayer
        if hidden.shape[-1] == 3 * c.target_hidden_size and hidden.shape[-1] != c.hidden_size:
            hidden = self.fc(self.fc_input(hidden) / self.aux_scale)  # aux_scale after the norms: module docstring
        b, t, h = hidden.shape
        a = layer.self_attn
        if token_qkv is None:  # x = [embed, hidden], the order SGLang's draft layers concatenate
            x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)], -1)
            projected = tuple(proj(x) for proj in a.in_projs())
        else:  # the hidden half's GEMM, with the token half added in its epilogue
            x = layer.hidden_norm(hidden).flatten(0, 1)
            projected = tuple(torch.addmm(y.flatten(0, 1), x, proj.weight[:, h:].T).view(b, t, y.shape[-1])
                              for y, proj in zip(token_qkv, a.in_projs(), strict=True))
        return *a.heads(projected, positions), hidden

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3Ht] -> what fc reads (before aux_scale): through input_norm (norm_before_fc), then each [Ht]
        chunk through its own fc_norm (SGLang's order when both are on)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, -1), strict=True)], -1)
        return aux

    def next_input(self, h2: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads: h2 (pre-norm), or norm(h2) = `normed` with norm_output."""
        return normed if self.config.norm_output else h2

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B,nh,T,d] -> h2 [B,T,H], the pre-norm output the next step consumes."""
        layer = self.midlayer
        h = residual + layer.self_attn.o_proj(attn.transpose(1, 2).flatten(2))  # also for 0 rows (pruned steps)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(self, hidden, tokens, positions, cache: DraftCache, visible: torch.Tensor | None = None):
        """Decode-time step over T new positions (appended to the cache after its valid ones),
        attending causally to the cache plus themselves, or to the slots `visible` [T,max_len] names
        (draft trees); -> (logits [B,T,Vd], the next step's input [B,T,H]: `next_input`)."""
        q, k, v, residual = self.qkv(hidden, tokens, positions)
        k_all, v_all, mask = cache.append(k, v, visible)
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        h2 = self.finish(attn, residual)
        normed = self.norm(h2)
        return self.lm_head(normed), self.next_input(h2, normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- SGLang-format checkpoint -------------------------------------------------------------
    def export_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items() if k not in EXPORT_EXCLUDE}
        sd["fc.weight"] = (sd["fc.weight"] / self.aux_scale.cpu()).contiguous()  # [H,3Ht] / [3Ht]
        return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in sd.items()}

    def save_pretrained(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        write_weights(out_dir, self.export_state_dict())
        atomic_write_json(out_dir / "config.json", self.config.to_sglang())
        atomic_write_json(out_dir / "eagle3_drafter.json", asdict(self.config))

    def save_speculators(self, out_dir: Path, verifier: Verifier, speculative_tokens: int, weights: Path) -> None:
        """The speculators-format dir `vllm serve <out_dir>` reads: its config.json beside the weights file
        save_pretrained wrote (`weights`: vLLM maps the same tensor names), hard-linked where the disk allows."""
        config = self.config.to_speculators(verifier, speculative_tokens)
        atomic_write(Path(out_dir) / "model.safetensors", lambda tmp: _link_or_copy(Path(weights), tmp))
        atomic_write_json(Path(out_dir) / "config.json", config)

    @classmethod
    def from_pretrained(cls, in_dir: Path, embed_weight: torch.Tensor, target_model_type: str,
                        target_num_layers: int) -> Eagle3Drafter:
        """Load a drafter dir of SGLang's or speculators' format (ours or another trainer's); embedding from the
        target."""
        in_dir = Path(in_dir)
        cfg_path = in_dir / "config.json"
        if not cfg_path.is_file():
            raise UserError(f"{cfg_path} missing: not a drafter dir (run `make train` first)")
        try:
            raw = json.loads(cfg_path.read_text())
            c = (DrafterConfig.from_speculators(raw, target_model_type) if "speculators_model_type" in raw
                 else DrafterConfig.from_sglang(raw, target_model_type, target_num_layers))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{cfg_path}: not valid JSON ({e})") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{cfg_path}: not an EAGLE-3 drafter config ({type(e).__name__}: {e})") from None
        vocab, hidden = embed_weight.shape
        if (c.vocab_size, c.target_hidden_size) != (vocab, hidden):
            raise UserError(f"{cfg_path}: drafter for a target of vocab {c.vocab_size} / hidden size "
                            f"{c.target_hidden_size}, but this target has {vocab} / {hidden}: pass the drafter "
                            "trained for this target (--draft) or set target.model to its target")
        try:
            weights = load_file(str(in_dir / "model.safetensors"))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{in_dir / 'model.safetensors'}: unreadable ({e})") from None
        return cls.from_export(c, weights, embed_weight, in_dir / "model.safetensors")

    def exported_copy(self) -> Eagle3Drafter:
        """A new drafter with exactly the weights save_pretrained would write (bf16-rounded, aux_scale
        folded into fc), on this one's device: what an engine would load, measured mid-training."""
        embed = self.embed_tokens.weight.detach()
        copy = Eagle3Drafter.from_export(self.config, self.export_state_dict(), embed.float().cpu(), "exported copy")
        return copy.to(embed.device)

    @classmethod
    def from_export(cls, c: DrafterConfig, weights: dict[str, torch.Tensor], embed_weight: torch.Tensor,
                    source) -> Eagle3Drafter:
        """A drafter from SGLang-format tensors (`source` names them in errors); embedding from the target."""
        model = cls(c)
        sd = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in weights.items()}
        sd["embed_tokens.weight"] = embed_weight
        sd["aux_scale"] = torch.ones(3 * c.target_hidden_size)
        if "d2t" not in sd:  # full-vocab head: identity mapping
            sd["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.int64)
            sd["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
        try:
            missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                         for k, v in sd.items()}, strict=False)
        except RuntimeError as e:  # size mismatches: weights of another shape than config.json says
            raise UserError(f"{source} does not fit its config.json: "
                            f"{str(e).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise UserError(f"{source}: missing {missing}, unexpected {unexpected}")
        return model


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copyfile(src, dst)


def write_weights(out_dir: Path, sd: dict[str, torch.Tensor]) -> None:
    """<out_dir>/model.safetensors, atomically, after the checks every drafter export owes: a NaN drafter loads
    everywhere and drafts garbage, an empty weight (a ZeRO-3 rank's partition where the gathered weights belong)
    is not the drafter's; either is refused, nothing written."""
    for name, w in sd.items():
        if w.is_floating_point() and not torch.isfinite(w).all():
            raise UserError(f"refusing to export {out_dir}: {name} has {int((~torch.isfinite(w)).sum())} "
                            "non-finite values (training diverged: lower train.lr or check the data)")
        if w.numel() == 0:
            raise UserError(f"refusing to export {out_dir}: {name} is empty, not the drafter's weights")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "model.safetensors", lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
