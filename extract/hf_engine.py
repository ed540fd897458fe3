"""In-process extraction: batches of at most a token budget, each captured by one forward
(core/target/hidden_capture.py, the capture train.source=online uses too)."""

from __future__ import annotations

from collections.abc import Iterator


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
