"""In-process extraction: one batched forward with output_hidden_states per token budget.

aux = concat(hidden_states[i] for i in aux_layers)  (input of decoder layer i: the convention of core/aux_layers.py)
final = hidden_states[-1]                            (post-final-norm; teacher logits = lm_head(final))
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def batches_by_tokens(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        if batch and lengths[i] * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@torch.inference_mode()
def extract_batch(model, seqs: list[list[int]], aux_layers: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Right-padded forward; per sample (the ids the model ran [T], on the CPU; aux [T,3H] and
    final [T,H] on the model's device). The batch is built on the CPU and sent in one copy."""
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    hs = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                     output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in aux_layers], dim=-1)
    final = hs[-1]
    return [(ids[i, : len(s)], aux[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]
