"""Attention of one TTT step: causal over step 0's keys plus the same-position keys of steps 1..k; in
packed rows (train/packing.py) step 0's keys only of the query's own document.

Three implementations of one function (train/ttt_loss.py's docstring gives the alignment):
- `dense_ttt_attention`: [T,T] scores with an fp32 softmax. Plain and exact; the CPU path, and the
  reference the tests hold the other to.
- `flex_ttt_attention`: PyTorch's flex attention over the concatenated keys of steps 0..k, with a block
  mask that visits only the causal blocks of step 0 and one diagonal block per later step. No [T,T]
  matrix exists, so memory is linear in T; the kernel is compiled (CUDA). Sequences are padded to
  whole blocks (`padded_length`): each step's keys then start on a block boundary.
- `merged_ttt_attention` (train.kernels.attention=cudnn): a causal fused-attention kernel over step 0's keys
  (its log-sum-exp kept) and the k diagonal terms, one score per row each, merged by log-sum-exp. The backward
  hands the kernel the merged output and log-sum-exp, so its P = exp(S - lse) are already the joint softmax's
  and no gradient through the kernel's own log-sum-exp is needed. The kernel: cuDNN's fused attention on CUDA
  (bf16/fp16), PyTorch's CPU flash kernel on CPU (any float: the tests' path). One document per row.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 128  # flex attention's default block size


def dense_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [B,nh,T,d]; keys/values: step 0..k, each [B,nkv,T,d]; doc_ids [B,T] (packed rows, train/packing.py):
    a step-0 key must also be in the query's document. -> [B,nh,T,d]."""
    nh, t, d = q.shape[1], q.shape[2], q.shape[3]
    rep = nh // keys[0].shape[1]
    ks = [k.repeat_interleave(rep, 1) for k in keys]
    vs = [v.repeat_interleave(rep, 1) for v in values]
    scale = d ** -0.5
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if doc_ids is not None:
        visible = visible & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])  # [B,1,T,T]
    s0 = (q @ ks[0].transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))  # [B,nh,T,T]
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in ks[1:]]  # k x [B,nh,T,1]
    p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
    out = p[..., :t] @ vs[0]
    for j, v in enumerate(vs[1:]):
        out = out + p[..., t + j:t + j + 1] * v
    return out


def padded_length(t: int) -> int:
    return -(-t // BLOCK) * BLOCK


def ttt_block_mask(t: int, steps: int, device: torch.device, doc_ids: torch.Tensor | None = None):
    """The BlockMask of TTT step `steps - 1` for a block-aligned length t: keys are steps 0..steps-1,
    each t long. Query block i reads step 0's blocks < i in full, and partially step 0's block i
    (causal) and block i of every later step (its diagonal). With doc_ids [B,t] (packed rows, each document
    one contiguous run) a step-0 key must also be in the query's document: step 0's blocks < i are then
    full only inside one document, partial where a document crosses into block i, and skipped otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    if t % BLOCK:
        raise ValueError(f"length {t} is not a multiple of {BLOCK}: pad with padded_length()")
    nb = t // BLOCK
    docs = torch.zeros(1, t, dtype=torch.long, device=device) if doc_ids is None else doc_ids
    first, last = docs[:, ::BLOCK], docs[:, BLOCK - 1::BLOCK]  # [B,nb]: the document of each block's ends
    qb = torch.arange(nb, device=device)
    before = qb[None, :] < qb[:, None]  # [nb,nb]: key block before query block
    diag = torch.eye(nb, dtype=torch.bool, device=device)
    full0 = before & (first[:, None, :] == last[:, :, None])  # [B,nb,nb]: one document across both blocks
    part0 = diag | (before & ~full0 & (last[:, None, :] == first[:, :, None]))
    part = torch.cat([part0, *[diag.expand_as(part0)] * (steps - 1)], -1)  # [B,nb,nb*steps]
    full = torch.cat([full0, torch.zeros_like(part[..., nb:])], -1)
    length = torch.tensor(t, device=device)

    def mask_mod(b, h, q_idx, kv_idx):  # exact on every pair (eager flex evaluates it densely)
        pos = kv_idx % length
        step0 = pos <= q_idx
        if doc_ids is not None:
            step0 = step0 & (doc_ids[b, pos] == doc_ids[b, q_idx])
        return torch.where(kv_idx < length, step0, pos == q_idx)

    return BlockMask.from_kv_blocks(*ordered_blocks(part), *ordered_blocks(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(t, t * steps))


def ordered_blocks(visits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B,nq,nk] bool -> BlockMask's (num [B,1,nq], indices [B,1,nq,nk]): each query block's visited key
    blocks first, in order."""
    num = visits.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~visits).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], block_mask,
                       compiled: bool = True) -> torch.Tensor:
    """`dense_ttt_attention` for block-aligned T, with `ttt_block_mask(T, len(keys), doc_ids)`. compiled=False
    runs flex's eager reference (CPU tests; it has no backward on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    k = keys[0] if len(keys) == 1 else torch.cat(keys, 2)
    v = values[0] if len(values) == 1 else torch.cat(values, 2)
    flex = _compiled_flex() if compiled else flex_attention
    return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def _causal_kernel(device_type: str):
    """-> (forward(q, k, v, scale) -> (out, lse [B,nh,T] fp32, state), backward(dout, q, k, v, out, lse, state,
    scale) -> (dq, dk, dv), grouped): a causal kernel whose backward takes any (out, lse) pair; grouped: it reads
    k/v with fewer heads than q (GQA) itself, so they need no copy per query head. CUDA: cuDNN's fused attention
    (its log-sum-exp is [B,nh,T,1], natural log; GQA native, which saves four [B,nh,T,d] copies and two head sums
    per step); CPU: PyTorch's flash kernel."""
    aten = torch.ops.aten
    if device_type == "cpu":
        def forward(q, k, v, scale):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            return out, lse, ()

        def backward(dout, q, k, v, out, lse, state, scale):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True,
                                                                             scale=scale)
        return forward, backward, False

    def forward(q, k, v, scale):  # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, debug)
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1].squeeze(-1), r[2:8]

    def backward(dout, q, k, v, out, lse, state, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, True, scale=scale)
    return forward, backward, True


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B,nkv,T,d] -> [B,nkv*rep,T,d]: the kernel's key/value heads, one per query head."""
    return x if rep == 1 else x.repeat_interleave(rep, 1)


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient of `_expand`: [B,nkv*rep,T,d] -> [B,nkv,T,d]."""
    b, n, t, d = x.shape
    return x if rep == 1 else x.view(b, n // rep, rep, t, d).sum(2)


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] zero-padded to [..., width]: the causal kernels take one head dim for q, k and v, an MLA drafter
    has v heads narrower than its q/k heads. Zero columns change no score and give zero output columns."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()


def _grouped(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """[B,nh,T,...] -> [B,nkv,rep,T,...]: query heads grouped by the key head they share (GQA), no copy."""
    return x.unflatten(1, (nkv, x.shape[1] // nkv))


def merge_diagonal(q, out0, lse0, keys, values):
    """The causal kernel's (out0 [B,nh,T,d], lse0 [B,nh,T]) and the diagonal keys/values (tuples of
    [B,nkv,T,d]) under one softmax -> (out in q's dtype, lse [B,nh,T] fp32)."""
    nkv, scale = keys[0].shape[1] if keys else 1, q.shape[-1] ** -0.5
    qg = _grouped(q.float(), nkv)
    scores = [(qg * k.float()[:, :, None]).sum(-1).flatten(1, 2) * scale for k in keys]  # [B,nh,T] each
    lse = torch.logsumexp(torch.stack([lse0.float(), *scores]), 0)
    out = out0.float() * (lse0 - lse).exp()[..., None]
    for s, v in zip(scores, values, strict=True):
        out = out + _grouped((s - lse).exp()[..., None], nkv).mul(v.float()[:, :, None]).flatten(1, 2)
    return out.to(q.dtype), lse


def diagonal_grads(q, out, lse, dout, keys, values):
    """Backward of the diagonal terms: -> (their share of dq [B,nh,T,d] fp32, dk and dv of each diagonal
    key/value). delta = rowsum(dout * out) is the softmax backward's row term, as in the kernel's."""
    nkv, scale = keys[0].shape[1], q.shape[-1] ** -0.5
    qg, dog = _grouped(q.float(), nkv), _grouped(dout.float(), nkv)
    delta = _grouped((dout.float() * out.float()).sum(-1), nkv)  # [B,nkv,rep,T]
    lseg = _grouped(lse, nkv)
    dq, dkeys, dvalues = torch.zeros_like(qg), [], []
    for k, v in zip(keys, values, strict=True):
        kg, vg = k.float()[:, :, None], v.float()[:, :, None]  # [B,nkv,1,T,d]
        p = ((qg * kg).sum(-1) * scale - lseg).exp()  # [B,nkv,rep,T]: this diagonal key's weight
        ds = p * ((dog * vg).sum(-1) - delta)
        dq = dq + ds[..., None] * kg * scale
        dkeys.append((ds[..., None] * qg * scale).sum(2).to(k.dtype))
        dvalues.append((p[..., None] * dog).sum(2).to(v.dtype))
    return dq.flatten(1, 2), dkeys, dvalues


@functools.cache
def compiled(fn, dynamic: bool | None = None, backend: str = "inductor"):
    """torch.compile(fn), once per function and backend: the TTT step and unroll (train/ttt_loss.py) and, on CUDA,
    the diagonal merge below (one pass over each tensor instead of one per op; CPU runs the plain functions)."""
    # one graph per step k (k earlier keys) and shape family: more than dynamo's default limit of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=dynamic, backend=backend)


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, *kv):
        """q [B,nh,T,d]; kv = k_0..k_s, v_0..v_s (each [B,nkv,T,d]) -> [B,nh,T,d]."""
        n = len(kv) // 2
        keys, values = kv[:n], kv[n:]
        rep, scale = q.shape[1] // keys[0].shape[1], q.shape[-1] ** -0.5
        fwd, _, grouped = _causal_kernel(q.device.type)
        rep = 1 if grouped else rep  # the kernel's own GQA: k/v as they are
        width = max(q.shape[-1], values[0].shape[-1])
        out0, lse0, state = fwd(_widen(q, width), _widen(_expand(keys[0], rep), width),
                                _widen(_expand(values[0], rep), width), scale)
        out0 = out0[..., :values[0].shape[-1]]
        merge = compiled(merge_diagonal, dynamic=False) if q.is_cuda else merge_diagonal
        out, lse = merge(q, out0, lse0, tuple(keys[1:]), tuple(values[1:]))
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.state, ctx.rep, ctx.scale = state, rep, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        n = len(kv) // 2
        keys, values = kv[:n], kv[n:]
        rep, scale = ctx.rep, ctx.scale
        _, bwd, _ = _causal_kernel(q.device.type)
        dout = dout.contiguous()
        width, dqk, dvw = max(q.shape[-1], values[0].shape[-1]), q.shape[-1], values[0].shape[-1]
        dq, dk0, dv0 = bwd(_widen(dout, width), _widen(q, width), _widen(_expand(keys[0], rep), width),
                           _widen(_expand(values[0], rep), width), _widen(out, width), lse, ctx.state, scale)
        dq, dk0, dv0 = dq[..., :dqk], dk0[..., :dqk], dv0[..., :dvw]
        dkeys, dvalues = [_fold(dk0, rep)], [_fold(dv0, rep)]
        if n > 1:
            grads = compiled(diagonal_grads, dynamic=False) if q.is_cuda else diagonal_grads
            dq_diag, dk, dv = grads(q, out, lse, dout, tuple(keys[1:]), tuple(values[1:]))
            dq, dkeys, dvalues = (dq.float() + dq_diag).to(q.dtype), dkeys + list(dk), dvalues + list(dv)
        return dq, *dkeys, *dvalues


def merged_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """`dense_ttt_attention` without doc_ids, any T, through a causal fused kernel plus the diagonal terms.
    Inputs made contiguous first: on a GPU a fused kernel handed q/k/v as the step makes them (transposed
    [B,T,n,d] views) gave outputs and gradients far off from step 2 on; contiguous copies give bf16 rounding.
    torch.compile traces it (the autograd.Function and its kernels) into the step's graph: the unroll stays one
    graph with it."""
    return _MergedAttention.apply(q.contiguous(), *(k.contiguous() for k in keys), *(v.contiguous() for v in values))
