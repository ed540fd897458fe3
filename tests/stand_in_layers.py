"""Stand-ins for the serving engines' tensor-parallel layers (vLLM's and SGLang's QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, ReplicatedLinear, RMSNorm, embeddings) at tensor parallel 1, for
running the engines' real model constructors and `load_weights` (compiled from their source) on a CPU: each
weight is NaN until a loader fills it, and each loader copies into the slice its shard names, refusing any other
shape, as the engines' loaders do."""

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoadRecord:
    """What the stand-in weight loaders saw: (parameter, shard, source tensor id) per copy."""
    copies: list = field(default_factory=list)

    def loader(self, name: str, slices: dict):
        """A weight_loader for parameter `name`: copies the tensor into the slice of its shard (None: whole),
        refusing any other shape, as vLLM's loaders do for tensor parallel 1."""
        def weight_loader(param, loaded, shard_id=None):
            shard_id = shard_id if shard_id is not None else getattr(loaded, "shard_id", None)
            rows = slices[shard_id]
            target = param.data[rows]
            if tuple(target.shape) != tuple(loaded.shape):
                raise ValueError(f"{name}[{shard_id}]: checkpoint tensor {tuple(loaded.shape)}, vLLM builds "
                                 f"{tuple(target.shape)}")
            target.copy_(loaded)
            self.copies.append((name, shard_id, loaded.data_ptr()))
        return weight_loader


def stand_in_layers(record: LoadRecord) -> dict:
    """vLLM's parallel layers as the draft classes call them (tensor parallel 1): their weights, NaN until a
    loader fills them, their shard slices, and the forward a norm or projection computes."""
    def param(module, name, rows, cols, slices):
        shape = (rows,) if cols is None else (rows, cols)
        module.weight = nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
        module.weight.weight_loader = record.loader(name, slices)

    def sliced(sizes: Mapping) -> dict:
        ends = list(itertools.accumulate(sizes.values()))
        return {k: slice(e - s, e) for (k, s), e in zip(sizes.items(), ends, strict=True)}

    class Linear(nn.Module):
        def __init__(self, input_size, output_size, bias=False, prefix="", return_bias=True, **_):
            super().__init__()
            assert not bias, f"{prefix}: a bias (our drafter has none)"
            self.return_bias = return_bias
            param(self, prefix + ".weight", output_size, input_size, {None: slice(None)})

        def forward(self, x):
            y = F.linear(x, self.weight)
            return (y, None) if self.return_bias else y

    class QKVParallelLinear(Linear):
        def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=False,
                     prefix="", **_):
            nn.Module.__init__(self)
            assert not bias, f"{prefix}: a bias (our drafter has none)"
            kv = total_num_kv_heads or total_num_heads
            sizes = {"q": total_num_heads * head_size, "k": kv * head_size, "v": kv * head_size}
            self.return_bias = True
            param(self, prefix + ".weight", sum(sizes.values()), hidden_size, sliced(sizes))

    class MergedColumnParallelLinear(Linear):
        def __init__(self, input_size, output_sizes, bias=False, prefix="", **_):
            nn.Module.__init__(self)
            assert not bias, f"{prefix}: a bias (our drafter has none)"
            self.return_bias = True
            param(self, prefix + ".weight", sum(output_sizes), input_size, sliced(dict(enumerate(output_sizes))))

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6, **_):
            super().__init__()
            self.eps = eps
            param(self, f"RMSNorm({hidden_size})", hidden_size, None, {None: slice(None)})

        def forward(self, x, residual=None):  # vLLM's fused add: (norm(x + residual), x + residual)
            if residual is not None:
                x = x + residual
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
            return y if residual is None else (y, x)

    class Embedding(nn.Module):
        def __init__(self, num_embeddings, embedding_dim, prefix="", **_):
            super().__init__()
            param(self, prefix + ".weight", num_embeddings, embedding_dim, {None: slice(None)})

        def forward(self, ids):
            return F.embedding(ids, self.weight)

    return {"QKVParallelLinear": QKVParallelLinear, "MergedColumnParallelLinear": MergedColumnParallelLinear,
            "RowParallelLinear": Linear, "ReplicatedLinear": Linear, "RMSNorm": RMSNorm,
            "VocabParallelEmbedding": Embedding, "ParallelLMHead": Embedding}


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up


def load_problems(model, record: LoadRecord, tensors: dict[str, torch.Tensor], engine: str,
                  unread: tuple[str, ...] = (), shared: tuple[str, ...] = ()) -> list[str]:
    """Problems of the engine's real `model.load_weights(tensors)` on stand-in layers ([] = none): a tensor it drops
    without a word (but those it never reads by design, `unread`), a parameter it leaves unloaded (NaN; but those it
    takes from the target, `shared`), a misshapen shard (raised by the stand-in loaders)."""
    try:
        model.load_weights(iter(tensors.items()))
    except (ValueError, AssertionError) as e:
        return [f"load_weights raised: {e}"]
    consumed = {ptr for _, _, ptr in record.copies}
    problems = [f"{name}: dropped by {engine}'s load_weights" for name, t in tensors.items()
                if name not in unread and t.data_ptr() not in consumed]
    return problems + [f"{name}: never loaded (stays uninitialised)" for name, p in model.named_parameters()
                       if name not in shared and p.is_floating_point() and torch.isnan(p).any()]
