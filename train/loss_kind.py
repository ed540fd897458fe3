"""train.loss as the head loss reads it, apart from the loss code so that both the torch path
(train/draft_head_loss.py) and CUDA's kernel (train/head_loss_kernel.py) take it without importing each other."""

from __future__ import annotations

from typing import NamedTuple

TINY = 1e-30  # alpha below this (fp32 underflow of every overlap term) counts as this: -log alpha stays finite


class HeadLoss(NamedTuple):
    """train.loss and lk_lambda's weight lam = kl_scale * exp(-kl_decay * alpha)."""
    kind: str = "kl"
    kl_scale: float = 1.0
    kl_decay: float = 3.0


KL = HeadLoss()
