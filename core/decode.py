"""The decode engine shared by data_gen (batched generation) and eval (greedy baseline and chain
speculative decoding), on an HF causal LM with a DynamicCache.

Why not `model.generate`: we need the aux hidden states of every verified position, cache
rollback after a rejected draft, and per-step acceptance counts; a plain cached loop gives all
three and runs at the same speed (measured in docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from core.drafter import DraftCache, Eagle3Drafter


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (end-of-turn generated, included in tokens) | "length"
    accept_lengths: list[int] = field(default_factory=list)  # spec decoding: tokens per verification


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
             temperature: float = 0.0, generator: torch.Generator | None = None,
             bf16_prefill: bool = False) -> list[Generation]:
    """Batched generation with left padding; each row stops at its first stop id. The KV cache is
    static (allocated once) because a growing DynamicCache re-copies the whole cache every step
    (measured on CPU at batch 128: 0.36 vs 0.46 s/step; ~6% of a whole demo generation).
    bf16_prefill: the prompt pass runs under bf16 autocast (3.4x faster on AMX CPUs; ~40% of a demo
    generation was prefill), its K/V stored in the model's dtype; decode steps stay in that dtype."""
    device = model.device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    mask = torch.zeros(b, width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    stop = torch.tensor(stop_ids, device=device)
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    out = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    step_ids, filled = ids, 0
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        cache_pos = torch.arange(filled, filled + step_ids.shape[1], device=device)
        filled += step_ids.shape[1]
        if bf16_prefill and step_ids is ids:
            logits = _prefill_bf16(model, step_ids, mask, pos, cache)
        else:
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           cache_position=cache_pos, use_cache=True, logits_to_keep=1).logits[:, -1]
        nxt = _sample(logits, temperature, generator)
        for i in torch.nonzero(~done).flatten().tolist():
            out[i].append(int(nxt[i]))
        done |= torch.isin(nxt, stop)
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], dim=1)
    return [Generation(t, "stop" if t and t[-1] in stop_ids else "length") for t in out]


def _prefill_bf16(model, ids, mask, pos, cache: StaticCache) -> torch.Tensor:
    """Prompt pass under bf16 autocast into a throwaway cache, then its K/V copied into `cache` in the
    model's dtype (autocast leaves keys fp32 but values bf16, which a static cache can't hold)."""
    prefill = DynamicCache()
    with torch.autocast(model.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=prefill,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
    for i, layer in enumerate(prefill.layers):
        cache.update(layer.keys.to(model.dtype), layer.values.to(model.dtype), i)
    return logits.float()


def _target_step(model, ids: list[int], cache: DynamicCache, start: int, aux_layers: list[int]):
    """Run ids at positions start.. through the target; -> (logits [T,V], aux [T,3H])."""
    device = model.device
    x = torch.tensor([ids], device=device)
    pos = torch.arange(start, start + len(ids), device=device)[None]
    out = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1)
    return out.logits[0], aux


def _crop(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions (negative form: the one every transformers 5.x accepts)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _truncate(tokens: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return Generation(tokens[: i + 1], "stop")
    return Generation(tokens[:max_new_tokens], "length")


@torch.inference_mode()
def speculative_generate(model, drafter: Eagle3Drafter, prompt: list[int], max_new_tokens: int,
                         stop_ids: list[int], draft_steps: int) -> Generation:
    """Greedy chain speculative decoding (batch 1): draft K tokens, verify them in one target forward,
    keep the longest matching prefix plus the target's bonus token. Output == greedy output."""
    aux_layers = drafter.config.aux_layers
    device = model.device
    cache, dcache = DynamicCache(), DraftCache()
    logits, aux = _target_step(model, prompt, cache, 0, aux_layers)
    tokens = prompt + [int(logits[-1].argmax())]
    m = len(prompt)  # index of the newest token (not yet run through the target)
    # Drafter extend over positions 0..m-1: (aux_t, token_{t+1}).
    d_logits, h = drafter(aux[None], torch.tensor([tokens[1:]], device=device),
                          torch.arange(m, device=device)[None], dcache)
    accept_lengths = []
    while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] not in stop_ids:
        drafts, dl, dh = [], d_logits[:, -1:], h[:, -1:]
        for j in range(draft_steps):
            drafts.append(int(drafter.draft_to_target(dl[0, -1].argmax())))
            if j + 1 < draft_steps:
                dl, dh = drafter(dh, torch.tensor([[drafts[-1]]], device=device),
                                 torch.tensor([[m + j]], device=device), dcache)
        logits, aux = _target_step(model, [tokens[m]] + drafts, cache, m, aux_layers)
        verdict = logits.argmax(-1).tolist()
        a = 0
        while a < draft_steps and drafts[a] == verdict[a]:
            a += 1
        new = drafts[:a] + [verdict[a]]
        accept_lengths.append(a + 1)
        _crop(cache, m + a + 1)
        dcache.crop(m)
        tokens += new
        d_logits, h = drafter(aux[None, : a + 1], torch.tensor([new], device=device),
                              torch.arange(m, m + a + 1, device=device)[None], dcache)
        m += a + 1
    gen = _truncate(tokens[len(prompt):], max_new_tokens, stop_ids)
    gen.accept_lengths = accept_lengths
    return gen
