"""One writer per stage dir, and no writer while a later stage reads it: OS locks (flock) on <dir>/.lock.

A writer holds it exclusively, a reader (train reading hidden/ or conversations/, extract reading
conversations/) shared. The kernel drops a lock when its process dies, so a kill -9 never leaves a stale
lock behind. A second writer fails at once with the holder's pid, host and command instead of interleaving
its rows with the first one's; a writer (`--fresh` included) fails while a reader holds the dir, so it cannot
delete or rewrite what another stage is reading; a reader fails while a writer holds it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from core.run.errors import UserError

LOCK_FILE = ".lock"


@contextmanager
def stage_lock(directory: str | Path, stage: str):
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        if not holder:  # readers leave no line (the writer's is truncated when it ends); a writer writes its own at once
            raise UserError(f"{directory} is being read by a later stage (train or extract), or another {stage} is "
                            f"just starting: {stage} would change what it reads; wait for it to finish, stop it, or "
                            "pass another --run-dir") from None
        raise UserError(f"{directory} is being written by another {stage} ({holder}); one writer per stage dir: "
                        "wait for it, stop it, or pass another --run-dir") from None
    try:
        os.ftruncate(fd, 0)
        command = " ".join(sys.argv)[:300]
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%H:%M:%S')}: {command}\n".encode(), 0)
        yield
    finally:
        os.ftruncate(fd, 0)
        if created and os.listdir(directory) == [LOCK_FILE]:  # a run that wrote nothing leaves nothing
            os.unlink(directory / LOCK_FILE)
            directory.rmdir()
        os.close(fd)  # closing the last descriptor releases the flock


@contextmanager
def stage_reader(directory: str | Path, reader: str):
    """Hold `directory` (a finished stage's output) shared while `reader` reads it: its writer cannot start
    (nor `--fresh` delete it) meanwhile, and a writer still at work stops the reader at once, naming it."""
    directory = Path(directory)
    fd = _reader_fd(directory / LOCK_FILE) if directory.is_dir() else None  # missing: the reader's check names it
    if fd is None:  # a dir nobody can write (a read-only mount): no writer to wait for
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that is starting"
            raise UserError(f"{directory} is being written ({holder}): {reader} reads it only once that stage has "
                            "finished; wait for it, or stop it and rerun that stage") from None
        yield
    finally:
        os.close(fd)


def _reader_fd(lock: Path) -> int | None:
    """A descriptor to take `lock` shared with: read-only where it exists (a reader may read a read-only mount),
    created where it does not; None where it cannot be created (nobody can write there)."""
    try:
        return os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        pass
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
