"""Which prompts a drafter was trained on, so that eval says so when it measures on them: τ on a drafter's own
training prompts reads far above its held-out τ (the tiny config: 1.82 against 1.0), a figure that must never pass
for a held-out one.

A prompt is identified by its templated token ids up to the generation prompt: in a training sample, the ids before
its first trained (loss) token; in eval, the ids it sends. The same text through the same template gives the same
ids, whatever split, file or id it came from. train writes the digests beside the drafter (FILE); eval compares.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

FILE = "trained_prompts.json"


def digest(prompt_ids) -> str:
    return hashlib.sha256(torch.as_tensor(prompt_ids, dtype=torch.int32).numpy().tobytes()).hexdigest()[:16]


def sample_prompt_digest(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """The digest of a training sample's first prompt: its ids before the first trained token."""
    trained = torch.nonzero(loss_mask).flatten()
    return digest(input_ids[: int(trained[0]) if len(trained) else len(input_ids)])


def collect(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]], into: set[str]):
    """Pass (input_ids, loss_mask) pairs through, adding each sample's prompt digest to `into`: the digests come
    from the pass that reads the samples anyway (train's token counts), not from another one."""
    for input_ids, loss_mask in pairs:
        into.add(sample_prompt_digest(input_ids, loss_mask))
        yield input_ids, loss_mask


def record(digests: set[str]) -> dict:
    """What FILE holds."""
    return {"digests": sorted(digests)}


def trained_on(draft_dir: Path, items: list[tuple[str, list[int]]]) -> list[str] | None:
    """Ids of the eval prompts (id, templated ids) the drafter in draft_dir was trained on; None when it has no
    record (another trainer's drafter)."""
    path = Path(draft_dir) / FILE
    if not path.is_file():
        return None
    seen = set(json.loads(path.read_text())["digests"])
    return [pid for pid, ids in items if digest(ids) in seen]
