"""Crash-safe writes: temp file in the same dir, fsync, rename; appends are fsynced lines."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from core.run.errors import UserError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_umask() -> int:
    """Read without changing it (os.umask can only set, and a set-and-restore races other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_process_umask()  # what open() gives a new file: 0644 under the usual umask 022


def honour_umask(path: str | Path) -> None:
    """Give `path` (or every file under it) the mode a plain open() would: some writers (safetensors'
    save_file, tempfile) create 0600 files that a serving process of another user cannot read."""
    path = Path(path)
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        os.chmod(f, FILE_MODE)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_path), fsync it, then rename over `path`. A crash leaves the old file or none.
    The file gets the umask's mode whatever `write` created it with."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_partial_writes(directory: str | Path) -> int:
    """Delete the temp files (`.<name>.tmp<pid>`) that atomic_write left in `directory` when its
    process was killed mid-write; temps of a process still running are left alone. Returns the count."""
    removed = 0
    for path in Path(directory).glob(".*.tmp*"):
        pid = path.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Append whole lines and fsync; readers ignore a torn last line (see read_jsonl)."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of an append-only jsonl file; a torn last line (crash mid-append) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # last line without newline: torn write
                break
            raise UserError(f"{path}:{i + 1}: corrupt line in append-only log") from None
    return rows


def repair_jsonl(path: str | Path) -> None:
    """Cut a torn trailing line so the next append starts on a fresh line."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "rb+") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())
