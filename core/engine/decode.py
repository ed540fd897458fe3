"""The decode engine of data_gen (batched generation) and eval (the greedy or sampled baseline; speculative
decoding, core/engine/speculative.py, runs on the same calls): one target call (`target_forward`) over one static KV
cache type, split like gpt-fast into `prefill`, `decode_one` and `verify`. Batched generation decodes through
core/engine/decode_step.py's `DecodeStep`: decode_one's call without the host-side cache seek, so that it can replay
as a CUDA graph.

Why not `model.generate`: speculative decoding needs the aux hidden states of every verified
position, cache rollback after a rejected draft and per-round acceptance counts, and a speedup is
only fair when the baseline runs through the very same calls.
Why static caches: a growing cache re-copies itself every step (measured on CPU at batch 128: 0.36 vs
0.46 s/step), and fixed shapes are what torch.compile / CUDA graphs need. Rollback costs nothing: a
slot past a query's position is masked, and the next write at that position overwrites it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache, StaticCache

from core.engine.decode_step import DecodeStep
from core.run.errors import UserError


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (end-of-turn generated, included in tokens) | "length"
    # speculative decoding: tokens each verification added to `tokens`, so 1 + sum == len(tokens)
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # drafts each verification checked (0: a plain step)

    def drafting_rounds(self) -> list[int]:
        """accept_lengths of the verifications that drafted: the rounds τ counts, as llama.cpp counts."""
        return [a for a, d in zip(self.accept_lengths, self.drafted, strict=True) if d > 0]


def new_cache(model, max_len: int) -> StaticCache:
    """A static cache whose layers `_seek` can move: full attention only (checked once, here)."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length") or getattr(layer, "is_sliding", False):
            raise UserError(f"decode engine: {type(layer).__name__} cache layers are not supported (sliding "
                             "window or non-static attention); use a full-attention target")
    return cache


def _seek(cache: StaticCache, slot: int) -> None:
    """Make the next write land at `slot`: transformers' static layers append at their running length
    (and mask by it), so moving it back is the rollback, and the forward's writes overwrite the slots."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(slot)


def target_forward(model, cache: StaticCache, ids: torch.Tensor, start: int, attention_mask=None, position_ids=None,
                   aux_layers: list[int] | None = None, last_only: bool = False):
    """The one target call: ids [B,T] into cache slots start..start+T-1 -> (logits [B,T|1,V], aux
    [B,T,3H] or None). Positions default to the slots (batch 1, no padding)."""
    _seek(cache, start)
    if position_ids is None:
        position_ids = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    out = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                use_cache=True, output_hidden_states=bool(aux_layers), logits_to_keep=1 if last_only else 0)
    aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1) if aux_layers else None
    return out.logits, aux


# Prompt tokens per pass of a batched CPU prefill: many prompts in one pass are slower than groups of ~2k
# tokens, with the same logits to 5e-5 (the [B,T,I] MLP activations of one pass, tens of MB each, are what the
# elementwise ops stall on), and the prefill is a large share of a data_gen call (docs/PERFORMANCE.md).
CPU_PREFILL_TOKENS = 2048


def prefill(model, cache: StaticCache, ids: torch.Tensor, attention_mask=None, position_ids=None,
            aux_layers: list[int] | None = None, bf16: bool = False, cache_dtype: torch.dtype | None = None):
    """The prompt pass -> (last-position logits [B,V], aux [B,T,3H] or None). bf16: under autocast, its
    K/V stored in cache_dtype (default the model's). A batch of many prompts on a CPU runs in groups of
    rows (`CPU_PREFILL_TOKENS`), each into a scratch cache whose K/V then fill `cache`."""
    b, t = ids.shape
    rows = max(1, CPU_PREFILL_TOKENS // t) if model.device.type == "cpu" else b
    if bf16 or (rows < b and not aux_layers):
        return _prefill_groups(model, cache, ids, attention_mask, position_ids, min(rows, b), bf16,
                               cache_dtype or model.dtype), None
    logits, aux = target_forward(model, cache, ids, 0, attention_mask, position_ids, aux_layers, last_only=True)
    return logits[:, -1], aux


def decode_one(model, cache: StaticCache, token: torch.Tensor, slot: int, attention_mask=None,
               position_ids=None) -> torch.Tensor:
    """One new token per row [B] at cache slot `slot` -> next-token logits [B,V]."""
    return target_forward(model, cache, token[:, None], slot, attention_mask, position_ids, last_only=True)[0][:, -1]


def verify(model, cache: StaticCache, tokens: list[int], start: int, aux_layers: list[int]):
    """The newest token plus K drafts at positions start.. (batch 1) -> (logits [K+1,V], aux [1,K+1,3H])."""
    logits, aux = target_forward(model, cache, torch.tensor([tokens], device=model.device), start,
                                 aux_layers=aux_layers)
    return logits[0], aux


def bf16_copy(model):
    """The target with its weights cast to bf16, for `generate`'s decode_model (config and attention
    implementation carried over)."""
    return copy.deepcopy(model).to(torch.bfloat16)


def _prefill_groups(model, cache: StaticCache, ids, mask, pos, rows: int, bf16: bool, dtype: torch.dtype) -> torch.Tensor:
    """The prompt pass `rows` prompts at a time (bf16: under autocast, 3.4x faster on AMX CPUs), each group
    into a throwaway cache; their K/V are then copied into `cache` in `dtype`, the decode steps' (autocast
    leaves keys fp32 but values bf16, which a static cache can't hold). A bf16 model's own prefill is
    slower on a CPU: its batched lm_head expands the weight per row (14 s of a 128-row prompt pass)."""
    logits, groups = [], []
    for s in range(0, ids.shape[0], rows):
        scratch, part = DynamicCache(), slice(s, s + rows)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits.append(model(input_ids=ids[part], attention_mask=None if mask is None else mask[part],
                                position_ids=None if pos is None else pos[part], past_key_values=scratch,
                                use_cache=True, logits_to_keep=1).logits[:, -1].float())
        groups.append(scratch.layers)
    _seek(cache, 0)
    for i in range(len(groups[0])):
        cache.update(torch.cat([g[i].keys for g in groups]).to(dtype), torch.cat([g[i].values for g in groups]).to(dtype), i)
    return torch.cat(logits)


class Sampling(NamedTuple):
    """How a token is drawn: temperature 0 = greedy (argmax); generator: the draws' RNG (None: the global one)."""
    temperature: float = 0.0
    generator: torch.Generator | None = None


GREEDY = Sampling()


class DecodeRun(NamedTuple):
    """How `generate` runs its steps, never what they decode: bf16_prefill: the prompt pass under bf16 autocast;
    graphs: each step replayed as a CUDA graph; fuse: "" | "fused" | "exact": the step through torch.compile first
    (core/engine/decode_step.py); decode_model: the same target in another dtype (data_gen's bf16 copy: 2.3x faster
    decode steps on a CPU with native bf16) running the steps after the prefill (needs bf16_prefill)."""
    bf16_prefill: bool = False
    graphs: bool = False
    fuse: str = ""
    decode_model: object = None


EAGER = DecodeRun()


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Each row's next token from its logits [..., V]: the argmax at T <= 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one batch, built on the host and moved once -> (ids, mask, positions) [B,W]."""
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def _finished(tokens: list[int], stop_ids: set[int]) -> Generation:
    """A row's tokens up to and including its first stop id ("stop"), or all of them ("length")."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
    return Generation(tokens[:end], "stop" if end else "length")


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
             sampling: Sampling = GREEDY, run: DecodeRun = EAGER, check_every: int = 16) -> list[Generation]:
    """Batched generation with left padding: prefill, then one `DecodeStep` per token (run: `DecodeRun`) until
    every row has hit a stop id (kept in its tokens) or max_new_tokens. Batch 1 is eval's greedy baseline.
    Tokens stay on the device until the end, and "is every row done?" is asked only every `check_every` steps
    (each ask waits for the device); rows keep decoding past their stop meanwhile, and those tokens are
    dropped. At T>0 the generator is then wound back to where a loop that stops at once would leave it, so
    neither check_every nor graphs changes what is drawn next (generator None: the global RNG is not wound
    back)."""
    temperature, generator = sampling
    if max_new_tokens < 1 or check_every < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}, check_every = {check_every}; both must be >= 1")
    if run.decode_model is not None and not run.bf16_prefill:
        raise ValueError("decode_model needs bf16_prefill: only that prompt pass stores its K/V in another dtype")
    decoder = run.decode_model if run.decode_model is not None else model
    device = model.device
    ids, mask, pos = left_padded(prompts, device)
    b, width = ids.shape
    cache = new_cache(decoder, width + max_new_tokens)
    logits, _ = prefill(model, cache, ids, mask, pos, bf16=run.bf16_prefill, cache_dtype=decoder.dtype)
    step = DecodeStep(decoder, cache, torch.cat([mask, mask.new_ones(b, max_new_tokens)], 1), pos[:, -1:] + 1,
                      run.graphs, run.fuse)
    out = torch.empty(b, max_new_tokens, dtype=torch.long, device=device)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    states, since = [], 0  # the generator's state after each draw since the last check, from step `since`
    for i in range(max_new_tokens):
        out[:, i] = sample_token(logits, temperature, generator)
        if temperature > 0 and generator is not None:
            states.append(generator.get_state())
        if i + 1 == max_new_tokens:
            break
        if (i + 1) % check_every == 0:
            if bool(torch.isin(out[:, :i + 1], stop).any(-1).all()):
                break
            states, since = [], i + 1
        logits = step(out[:, i])
    stops = set(stop_ids)
    rows = [_finished(r, stops) for r in out[:, :i + 1].tolist()]
    if states:  # the stopping loop's last draw: the step at which its last row finished
        generator.set_state(states[max(len(r.tokens) for r in rows) - 1 - since])
    return rows
