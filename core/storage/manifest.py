"""manifest.json beside every artifact: resolved config, git SHA, inputs, counts, the compatibility
keys (target, hidden size, aux layers, vocab) the next stage checks, and the settings fingerprint.

Provenance: each stage records `settings`, everything that shapes its output (the upstream
manifest's fingerprint, the config keys of this stage, the data it read). A rerun resumes into an
output dir only when its settings are the same; otherwise it stops and says what changed, and
`--fresh` starts the stage over in place. So output is never a mix of two models, two configs or
two versions of the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

from core.run.config import RunConfig, to_dict
from core.run.errors import UserError
from core.storage.atomic_io import atomic_write_json
from core.storage.stage_lock import LOCK_FILE

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def git_sha() -> str:
    """HEAD of the code's checkout, "+dirty" when tracked files differ from it (a copied tree whose .git is
    older than its files, edits not committed): a manifest never names a commit the code was not."""
    try:
        git = ["git", "-C", str(Path(__file__).parent)]
        sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha + "+dirty" * bool(dirty)) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def write_manifest(out_dir: Path, stage: str, cfg: RunConfig, compat: dict, counts: dict,
                   inputs: dict | None = None, settings: dict | None = None, extra: dict | None = None) -> Path:
    return atomic_write_json(Path(out_dir) / MANIFEST, {
        "stage": stage, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": git_sha(), "config": to_dict(cfg), "compat": compat, "counts": counts,
        "inputs": inputs or {}, "settings": settings or {}, "fingerprint": fingerprint(settings or {}),
        **(extra or {}),
    })


def read_manifest(in_dir: Path, producer: str) -> dict:
    path = Path(in_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} missing: run `make {producer}` first (or point --run-dir at its output)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}); re-run `make {producer}`") from None


IN_PROGRESS = "in progress"


def read_finished_manifest(in_dir: Path, producer: str) -> dict:
    """An upstream stage's manifest, refused while it says the stage has not finished: a process still writing
    there, or one that was killed (its rerun finishes it). Reading it anyway trains on part of the data."""
    manifest = read_manifest(in_dir, producer)
    if manifest.get("counts", {}).get("status") == IN_PROGRESS:
        raise UserError(f"{Path(in_dir) / MANIFEST}: the {manifest.get('stage', producer)} stage has not finished "
                        f"there (its manifest says {IN_PROGRESS!r}: another process is still writing, or it was "
                        f"stopped); wait for it, or rerun `make {producer}` to finish it")
    return manifest


def check_compat(manifest: dict, expected: dict, where: Path) -> None:
    """Fail with both values printed when an upstream artifact was made for something else."""
    have = manifest.get("compat", {})
    for key, want in expected.items():
        if key not in have:
            raise UserError(f"{where}/{MANIFEST}: no compat.{key} (this run expects {want!r}); "
                            "re-run the producing stage")
        if have[key] != want:
            raise UserError(f"{where}/{MANIFEST}: {key} = {have[key]!r} but this run expects {want!r}; "
                            f"re-run the producing stage or fix the config")


def _changes(old, new, key: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in sorted(set(old) | set(new))
                for c in _changes(old.get(k), new.get(k), f"{key}.{k}" if key else k)]
    return [] if old == new else [f"{key}: {old!r} -> {new!r}"]


def open_stage_dir(out_dir: Path, stage: str, settings: dict, fresh: bool) -> None:
    """Ready out_dir for output made with `settings`: empty it when fresh; otherwise resume only
    into output of the same settings. Call with the stage lock held."""
    out_dir = Path(out_dir)
    entries = [p for p in out_dir.iterdir() if p.name != LOCK_FILE] if out_dir.is_dir() else []
    if fresh and entries:
        log.info("--fresh: removing the %d entries of %s", len(entries), out_dir)
        for p in entries:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return
    if not entries:
        return
    make_target = {"data_gen": "generate"}.get(stage, stage)
    old = read_manifest(out_dir, make_target).get("settings") if (out_dir / MANIFEST).is_file() else None
    if old is None:
        raise UserError(f"{out_dir} holds {stage} output without recorded settings (an older version or "
                        "another tool made it): pass --fresh to start over in place, or another --run-dir")
    if changed := _changes(old, settings):
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        raise UserError(f"{out_dir} was made with other settings: {'; '.join(changed[:4])}{more}. It cannot be "
                        f"resumed: pass --fresh to redo {stage} in place, or another --run-dir")
