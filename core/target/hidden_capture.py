"""The in-process capture of the target's hidden states: one forward with output_hidden_states.
Used by extract (hf engine: captures written to shards) and train (train.source=online: captures
trained on at once), so both train on the same tensors.

aux = concat(hidden_states[i] for i in aux_layers)  (input of decoder layer i: the convention of core/target/aux_layers.py)
final = hidden_states[-1]                            (post-final-norm; teacher logits = lm_head(final))
"""

from __future__ import annotations

import torch


def capture_compat(cfg, info, aux_layers: list[int]) -> dict:
    """The keys a drafter trained on these captures must match (target, hidden size, layers, vocab)."""
    return {"target": cfg.target.model, "hidden_size": info.hidden_size, "aux_layers": aux_layers,
            "vocab_size": info.vocab_size}


@torch.no_grad()  # not inference_mode: online training feeds the captures to autograd as inputs
def capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layers: list[int],
            precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B,T] and mask [B,T] (1 on real tokens) on the model's device -> (aux [B,T,3H],
    final [B,T,H]) in the model's dtype. precision "bf16": the matmuls under bf16 autocast
    (extract.mixed_precision); the residual stream stays in the model's dtype."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        hs = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in aux_layers], dim=-1), hs[-1]  # [B,T,3H], [B,T,H]


def extract_batch(model, seqs: list[list[int]], aux_layers: list[int],
                  precision: str = "fp32") -> list[tuple[torch.Tensor, ...]]:
    """Per sample (the ids the model ran [T], on the CPU; aux [T,3H] and final [T,H] on the model's
    device). The right-padded batch is built on the CPU and sent in one copy."""
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    aux, final = capture(model, ids.to(model.device), mask.to(model.device), aux_layers, precision)
    return [(ids[i, : len(s)], aux[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]
