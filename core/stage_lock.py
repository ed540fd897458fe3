"""One writer per stage dir: an OS lock (flock) on <dir>/.lock.

The kernel drops the lock when its process dies, so a kill -9 never leaves a stale lock behind,
and a second writer fails at once with the holder's pid, host and command instead of interleaving
its rows with the first one's.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from core.errors import UserError

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
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that is starting"
        os.close(fd)
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
