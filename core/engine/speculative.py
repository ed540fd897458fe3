"""Speculative decoding, batch 1 (eval's hf engine and train's τ probe): the drafter proposes a chain of K
tokens (or an EAGLE-2 tree, core/drafters/draft_tree.py), the target verifies them in one call of core/engine/decode.py's
engine, and the round keeps what the target agrees with plus its own next token; greedy (the output equals
`generate`'s) or sampled (speculative sampling: distributed as the target's own sampling). The drafter keeps
its K/V in its static `DraftCache`, rolled back after each round like the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import StaticCache

from core.drafters.draft_tree import DraftTree, TreeSpec, draft_tree
from core.drafters.drafter import DraftCache, Eagle3Drafter
from core.engine.decode import (
    GREEDY,
    Generation,
    Sampling,
    new_cache,
    prefill,
    sample_token,
    target_forward,
    verify,
)


class Drafting(NamedTuple):
    """What is drafted per verification: a chain of up to `steps` tokens, ended early at a draft whose
    `draft_confidence` is below p_min (greedy chain, as llama.cpp's --spec-draft-p-min), or an EAGLE-2 tree."""
    steps: int
    tree: TreeSpec | None = None
    p_min: float = 0.0


def draft_confidence(logits: torch.Tensor) -> float:
    """The probability llama.cpp's --spec-draft-p-min compares: its draft sampler keeps the 10 likeliest
    tokens and takes their softmax (top-k 10, then dist), so this is the top one's share of those 10."""
    top = logits.float().topk(min(10, logits.shape[-1])).values
    return float(torch.softmax(top, -1)[0])


def draft_chain(drafter: Eagle3Drafter, logits: torch.Tensor, hidden: torch.Tensor, m: int, cache: DraftCache,
                drafting: Drafting, sampling: Sampling = GREEDY):
    """Up to K drafts from the drafter's output at position m-1 (logits [1,Vd], hidden [1,1,H]): draft j
    is fed back at position m+j to propose draft j+1 (training's step j+1, train/ttt_loss.py). Greedy at
    T=0, where p_min > 0 ends the chain at the first draft whose `draft_confidence` is below it (no
    verify row spent on a likely reject); at T>0 each draft is sampled from q = softmax(logits/T),
    returned per draft for the acceptance test -> (drafts in target ids, [q_j over the draft vocab] or None)."""
    (steps, _, p_min), (temperature, generator) = drafting, sampling
    drafts, qs = [], []
    for j in range(steps):
        if p_min > 0 and draft_confidence(logits[0]) < p_min:
            break
        if temperature > 0:
            qs.append(torch.softmax(logits[0].float() / temperature, -1))
            pick = torch.multinomial(qs[-1], 1, generator=generator)[0]
        else:
            pick = logits[0].argmax()
        drafts.append(int(drafter.draft_to_target(pick)))
        if j + 1 < steps:
            step_logits, hidden = drafter(hidden, torch.tensor([[drafts[-1]]], device=hidden.device),
                                          torch.tensor([[m + j]], device=hidden.device), cache)
            logits = step_logits[:, -1]
    return drafts, (qs if temperature > 0 else None)


def accept_sampled(drafts: list[int], qs: list[torch.Tensor], logits: torch.Tensor, drafter: Eagle3Drafter,
                   sampling: Sampling) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): keep draft j with probability
    min(1, p_j(x)/q_j(x)); at the first rejection sample from max(p_j - q_j, 0), renormalised; if all
    K survive, sample the bonus from p_K. Every emitted token is then distributed exactly as the
    target samples it at temperature T. -> (drafts accepted, the next token)."""
    temperature, generator = sampling
    p = torch.softmax(logits.float() / temperature, -1)  # [K+1, V]
    if not drafts:
        return 0, int(torch.multinomial(p[0], 1, generator=generator)[0])
    in_target = drafter.draft_to_target(torch.arange(qs[0].numel(), device=logits.device))
    for j, x in enumerate(drafts):
        q = torch.zeros_like(p[j])
        q[in_target] = qs[j]
        if torch.rand((), generator=generator, device=p.device) * q[x] < p[j, x]:
            continue
        residual = (p[j] - q).clamp(min=0)
        residual = residual if residual.sum() > 0 else p[j]
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0])
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator)[0])


def verify_tree(model, cache: StaticCache, root: int, tree: DraftTree, m: int, aux_layers: list[int]):
    """The newest token (slot m) and the tree's nodes (slots m+1..) in one target forward, each node
    seeing the prefix, the root and its own ancestors -> (logits [N+1,V], aux [1,N+1,3H])."""
    n = len(tree.tokens)
    mask = torch.zeros(1, 1, n + 1, cache.get_max_length(), dtype=torch.bool, device=model.device)
    mask[..., : m + 1] = True
    mask[0, 0, 1:, m + 1: m + 1 + n] = tree.visible().to(model.device)
    positions = torch.tensor([[m] + [m + d for d in tree.depths]], device=model.device)
    logits, aux = target_forward(model, cache, torch.tensor([[root, *tree.tokens]], device=model.device), m, mask,
                                 positions, aux_layers)
    return logits[0], aux


def accept_chain(drafts: list[int], verdict: list[int]) -> tuple[int, int]:
    """Greedy verification of a chain (EAGLE-3's or a DFlash block): verdict[j] is the target's argmax after
    drafts[:j] -> (drafts accepted: the longest prefix the target agrees with, the target's next token)."""
    a = next((j for j in range(len(drafts)) if drafts[j] != verdict[j]), len(drafts))
    return a, verdict[a]


def accept_tree(tree: DraftTree, verdict: list[int]) -> tuple[list[int], int]:
    """Greedy walk from the root: follow the child whose token is the target's argmax (verdict[0] at
    the root, verdict[i+1] at node i) -> (accepted node indices, the target's next token)."""
    path, parent, row = [], -1, 0
    while True:
        child = next((i for i, p in enumerate(tree.parents) if p == parent and tree.tokens[i] == verdict[row]), None)
        if child is None:
            return path, verdict[row]
        path.append(child)
        parent, row = child, child + 1


def _compact(cache: StaticCache, slots: list[int], start: int) -> None:
    """Move the accepted nodes' K/V from their tree slots to start.. (the chain order the next round
    extends); nothing to do when they already sit there."""
    if slots == list(range(start, start + len(slots))):
        return
    src = torch.tensor(slots, device=cache.layers[0].keys.device)
    dst = torch.arange(start, start + len(slots), device=src.device)
    for layer in cache.layers:
        layer.keys[:, :, dst] = layer.keys[:, :, src]
        layer.values[:, :, dst] = layer.values[:, :, src]


def emitted_tokens(candidates: list[int], stop_ids: list[int], budget: int) -> list[int]:
    """The tokens a verification adds: up to and including the first stop id, at most `budget`."""
    for i, t in enumerate(candidates):
        if t in stop_ids:
            candidates = candidates[: i + 1]
            break
    return candidates[:budget]


def acceptance_length(accept_lengths: list[int]) -> float:
    """τ: mean tokens per target verification (accepted drafts + the target's own token); 1 when no round
    drafted (every token a plain target step)."""
    return sum(accept_lengths) / len(accept_lengths) if accept_lengths else 1.0


@torch.inference_mode()
def speculative_generate(model, drafter: Eagle3Drafter, prompt: list[int], max_new_tokens: int,
                         stop_ids: list[int], drafting: Drafting, sampling: Sampling = GREEDY) -> Generation:
    """Speculative decoding (batch 1): draft a chain of K tokens (or an EAGLE-2 tree), verify them in
    one target forward, keep what the target agrees with plus the target's own next token. At T=0 the
    output equals greedy decoding; at T>0 (chain only) it is distributed as the target's sampling.
    p_min > 0 (greedy chain) stops drafting at an unsure draft, as llama.cpp does; a round with no
    draft is a plain target step. A round that accepts a stop id ends generation: nothing after it is
    emitted or counted."""
    (draft_steps, tree, p_min), temperature = drafting, sampling.temperature
    if max_new_tokens < 1 or draft_steps < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}, draft_steps = {draft_steps}; both must be >= 1")
    if tree is not None and temperature > 0:
        raise ValueError("tree drafting is greedy only (T=0); sample with a chain (no eval.draft_tree)")
    if p_min > 0 and (tree is not None or temperature > 0):
        raise ValueError("p_min stops a greedy chain (T=0, no eval.draft_tree), as llama.cpp's --spec-draft-p-min")
    device, aux_layers = model.device, drafter.config.aux_layers
    width = tree.total if tree else draft_steps
    max_len = len(prompt) + max_new_tokens + width + 1
    cache = new_cache(model, max_len)
    dcache = DraftCache(max_len + (tree.depth * tree.topk if tree else 0))
    logits, aux = prefill(model, cache, torch.tensor([prompt], device=device), aux_layers=aux_layers)
    out = [int(sample_token(logits, *sampling)[0])]
    m = len(prompt)  # position of out[-1], the newest token, not yet run through the target
    accept_lengths, drafted = [], []
    # The drafter reads (aux_t, token_{t+1}) at positions 0..m-1.
    d_logits, h = drafter(aux, torch.tensor([prompt[1:] + out], device=device), torch.arange(m, device=device)[None],
                          dcache)
    while out[-1] not in stop_ids and len(out) < max_new_tokens:
        if tree is None:
            # no more drafts than the budget can emit beside the target's own token (llama.cpp's cap too)
            steps = min(draft_steps, max_new_tokens - len(out) - 1)
            drafts, qs = draft_chain(drafter, d_logits[:, -1], h[:, -1:], m, dcache, drafting._replace(steps=steps),
                                     sampling)
            logits, aux = verify(model, cache, [out[-1], *drafts], m, aux_layers)
            if temperature > 0:
                a, nxt = accept_sampled(drafts, qs, logits, drafter, sampling)
            else:
                a, nxt = accept_chain(drafts, logits.argmax(-1).tolist())
            accepted, rows, n_drafts = drafts[:a], list(range(a + 1)), len(drafts)
        else:
            grown = draft_tree(drafter, d_logits[:, -1], h[:, -1:], m, tree, dcache)
            logits, aux = verify_tree(model, cache, out[-1], grown, m, aux_layers)
            path, nxt = accept_tree(grown, logits.argmax(-1).tolist())
            _compact(cache, [m + 1 + i for i in path], m + 1)
            accepted, rows, n_drafts = [grown.tokens[i] for i in path], [0] + [1 + i for i in path], len(grown.tokens)
        new = emitted_tokens(accepted + [nxt], stop_ids, max_new_tokens - len(out))
        accept_lengths.append(len(new))
        drafted.append(n_drafts)
        out += new
        if out[-1] in stop_ids or len(out) >= max_new_tokens:
            break
        dcache.rollback(m)  # forget the drafts; the accepted tokens are re-read with the target's aux
        d_logits, h = drafter(aux[:, rows], torch.tensor([new], device=device),
                              torch.arange(m, m + len(new), device=device)[None], dcache)
        m += len(new)
    return Generation(out, "stop" if out[-1] in stop_ids else "length", accept_lengths, drafted)
