"""Conversations (data_gen -> extract): parquet parts written with HF datasets, one row per sample.

Row: id (unique sample id), conversation_id (the regenerated conversation; a template that rewrites
earlier turns splits one conversation into several samples), messages [{role, content,
reasoning_content}], input_ids int32[], loss_mask uint8[] (1 exactly on tokens the target generated,
end-of-turn included), finish_reason ("length" if any answer hit max_tokens, else "stop"), turns
(assistant turns), template_hash, model_id. Parts are append-only and committed atomically, so the
set of conversation ids already written is the resume point. Each part has its sha256 beside it
(`part-NNNNN.parquet.sha256`, committed before the part), checked by every reader: a changed byte or a cut
file is one line naming the part, never rows read from it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from core.run.errors import UserError
from core.storage.atomic_io import atomic_write
from core.storage.manifest import check_compat, read_finished_manifest

FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "conversation_id": datasets.Value("string"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string"),
                               "reasoning_content": datasets.Value("string")}),
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("uint8")),
    "finish_reason": datasets.Value("string"),
    "turns": datasets.Value("int32"),
    "template_hash": datasets.Value("string"),
    "model_id": datasets.Value("string"),
})


def template_hash(chat_template: str) -> str:
    return hashlib.sha256(chat_template.encode()).hexdigest()[:16]


def part_files(conv_dir: Path) -> list[Path]:
    return sorted(Path(conv_dir).glob("part-*.parquet"))


def _digest_path(part: Path) -> Path:
    return part.with_name(part.name + ".sha256")


def write_part(conv_dir: Path, rows: list[dict]) -> Path:
    """Commit rows as the next part file (atomic), its sha256 first: a part on disk always has its digest."""
    conv_dir = Path(conv_dir)
    n = max((int(f.name[5:10]) for f in part_files(conv_dir)), default=-1) + 1  # past a part removed by hand
    ds = datasets.Dataset.from_list(rows, features=FEATURES)
    # pyarrow directly: the same file (features in its schema metadata) without a progress bar per part
    out = pa.BufferOutputStream()
    pq.write_table(ds.data.table, out)
    data = out.getvalue().to_pybytes()
    part = conv_dir / f"part-{n:05d}.parquet"
    atomic_write(_digest_path(part), lambda p: p.write_text(hashlib.sha256(data).hexdigest() + "\n"))
    return atomic_write(part, lambda p: p.write_bytes(data))


def read_part(part: Path, columns: list[str] | None = None) -> pa.Table:
    """A committed part, its bytes checked against the sha256 data_gen wrote beside it."""
    remedy = "delete it (and its .sha256) and rerun data_gen to regenerate its conversations"
    digest = _digest_path(part)
    if not digest.is_file():
        raise UserError(f"{part}: no {digest.name} beside it (written by an older version or by hand), so its "
                        f"bytes cannot be checked: {remedy}")
    data = part.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest.read_text().strip():
        raise UserError(f"{part}: its bytes changed since data_gen wrote it (sha256 differs from {digest.name}): "
                        f"{remedy}")
    try:
        return pq.read_table(pa.BufferReader(data), columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{part}: not a readable parquet part ({e}): {remedy}") from None


def read_conversations(conv_dir: Path) -> datasets.Dataset:
    files = part_files(conv_dir)
    if not files:
        raise UserError(f"no conversations in {conv_dir}: run `make generate` first")
    tables = [read_part(f) for f in files]
    return datasets.concatenate_datasets([datasets.Dataset(t) for t in tables])


def read_conversations_for(conv_dir: Path, target: str) -> tuple[dict, datasets.Dataset]:
    """What a consumer of conversations reads (extract, and train with train.source=online): data_gen's
    manifest, checked to be for `target`, and every committed row -> (manifest, rows)."""
    manifest = read_finished_manifest(conv_dir, "generate")
    check_compat(manifest, {"target": target}, conv_dir)
    return manifest, read_conversations(conv_dir)


def done_ids(conv_dir: Path) -> set[str]:
    """Conversation ids in committed parts (what a rerun skips)."""
    return {i for f in part_files(conv_dir)
            for i in read_part(f, ["conversation_id"]).column("conversation_id").to_pylist()}
