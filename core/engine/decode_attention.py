"""The target's attention for decode steps: one query token per row, grouped-query attention that reads
each layer's K/V once (`load_target` switches every target to it; core/engine/decode.py decodes through it).

Why: a static-cache decode step passes a padding mask, and with a mask transformers' SDPA integration
(since 5.17) refuses SDPA's native GQA on CUDA and calls `repeat_kv`, copying every
layer's K and V G times each step before a masked kernel. SmolLM2 (9 query heads on 3 KV heads) at
long prompts then decoded at a few percent of a GPU's bandwidth bound (docs/PERFORMANCE.md). With
one query token the grouping is a view: the G query heads that share KV head k (heads k*G..k*G+G-1,
as repeat_kv pairs them) are G rows against that head's K/V, so one SDPA call reads the cache once.
Every call with more query tokens (prefill, verify, tree verify, hidden-state captures) runs
transformers' SDPA unchanged, and the masks are built exactly as for "sdpa".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "eagle3_decode"


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """query [B,H,1,D], key [B,KVH,L,D], value [B,KVH,L,Dv], mask broadcastable to [B,1,1,L] (bool, True =
    attend, or additive float) or None -> [B,1,H,Dv], transformers' attention-output layout. One SDPA call
    whose G "query positions" per KV head are that head's G query heads (the one mask row fits them all),
    so the kernel reads K/V once, fused, with its own fp32 softmax; no shape depends on the data and
    nothing waits for the device (CUDA-graph capturable)."""
    b, h, _, d = query.shape
    kvh = key.shape[1]
    out = F.scaled_dot_product_attention(query.reshape(b, kvh, h // kvh, d), key, value, attn_mask=mask,
                                         scale=scaling)  # [B,KVH,G,Dv]
    return out.reshape(b, 1, h, value.shape[-1])


def decode_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """An AttentionInterface function: one query token without dropout -> `grouped_decode_attention`,
    anything else -> transformers' `sdpa_attention_forward`, unchanged."""
    if query.shape[2] != 1 or dropout > 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return grouped_decode_attention(query, key, value, attention_mask, scale), None


AttentionInterface.register(NAME, decode_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model) -> None:
    """Switch a target that runs SDPA to NAME (a target on another implementation keeps it)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
