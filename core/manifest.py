"""manifest.json beside every artifact: resolved config, git SHA, inputs, counts, and the
compatibility keys (target, hidden size, aux layers, vocab) the next stage checks."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from core.atomic_io import atomic_write_json
from core.config import RunConfig, to_dict


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_manifest(out_dir: Path, stage: str, cfg: RunConfig, compat: dict, counts: dict,
                   inputs: dict | None = None) -> Path:
    return atomic_write_json(Path(out_dir) / "manifest.json", {
        "stage": stage, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": git_sha(), "config": to_dict(cfg), "compat": compat, "counts": counts,
        "inputs": inputs or {},
    })


def read_manifest(in_dir: Path, producer: str) -> dict:
    path = Path(in_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `make {producer}` first (or point --run-dir at its output)")
    return json.loads(path.read_text())


def check_compat(manifest: dict, expected: dict, where: Path) -> None:
    """Fail with both values printed when an upstream artifact was made for something else."""
    have = manifest.get("compat", {})
    for key, want in expected.items():
        if key not in have:
            raise ValueError(f"{where}/manifest.json: no compat.{key} (this run expects {want!r}); "
                             "re-run the producing stage")
        if have[key] != want:
            raise ValueError(f"{where}/manifest.json: {key} = {have[key]!r} but this run expects {want!r}; "
                             f"re-run the producing stage or fix the config")
