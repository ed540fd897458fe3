"""What a target weighs, from its config.json alone: parameters by arithmetic (a 1T-parameter target costs
nothing to size), bytes per dtype, and what one process can hold. core/run/plan.py prints it; the target's
loader refuses a target that cannot fit before loading anything (core/target/model.py)."""

from __future__ import annotations

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def target_params(tc: dict) -> int:
    """Parameters of the target's language model from its config (core.target.model.read_target_config): GQA or MLA
    attention (DeepSeek-V3 / Kimi: q/kv LoRA ranks), dense or MoE MLPs (routed + shared experts after
    `first_k_dense_replace` dense layers), norms, embedding and head (once when tied). Arithmetic, so a 1T
    target costs nothing to plan (tests/test_kimi_plan.py checks it against transformers' own modules;
    Qwen3 adds its per-head q/k norms)."""
    h, heads, layers, vocab = tc["hidden_size"], tc["num_attention_heads"], tc["num_hidden_layers"], tc["vocab_size"]
    if tc.get("kv_lora_rank"):
        qk, qr, kvr = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"], tc.get("q_lora_rank"), tc["kv_lora_rank"]
        q = h * qr + qr + qr * heads * qk if qr else h * heads * qk  # (+ the q LoRA norm)
        attn = (q + h * (kvr + tc["qk_rope_head_dim"]) + kvr + kvr * heads * (tc["qk_nope_head_dim"] + tc["v_head_dim"])
                + heads * tc["v_head_dim"] * h)
    else:
        d = tc.get("head_dim") or h // heads
        kv = tc.get("num_key_value_heads") or heads
        attn = h * heads * d + 2 * h * kv * d + heads * d * h + (2 * d if tc["model_type"].startswith("qwen3") else 0)
    dense_mlp = 3 * h * tc["intermediate_size"]
    experts = tc.get("n_routed_experts") or 0
    moe_layers = layers - (tc.get("first_k_dense_replace") or 0) if experts else 0
    moe_mlp = (experts + (tc.get("n_shared_experts") or 0)) * 3 * h * tc.get("moe_intermediate_size", 0) \
        + experts * h + (experts if tc.get("topk_method") == "noaux_tc" else 0)  # router (+ its score bias)
    per_layer_norms = 2 * h
    embed = vocab * h * (1 if tc.get("tie_word_embeddings") else 2)
    return (layers * (attn + per_layer_norms) + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
            + embed + h)


def device_memory(device) -> int:
    """Bytes one process can hold on `device`: the GPU's memory, or the machine's RAM for a CPU."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human_bytes(b: float) -> str:
    """1536 -> "1.5 KiB": binary units, one decimal."""
    units = [("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)]
    unit, size = next(((u, n) for u, n in units if b >= n), ("B", 1))
    return f"{b / size:,.1f} {unit}"
