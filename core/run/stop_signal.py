"""SIGTERM as a request to stop at the next safe point, instead of an instant death.

`timeout`, `kill` and job schedulers (SLURM, Kubernetes) send SIGTERM before they kill. A stage that
holds finished work in memory (data_gen's `hf` pool keeps finished conversations until their part is
whole) can then commit it and exit, so a time-boxed run keeps what it made. The handler only sets a
flag: the stage asks it between units of work, never in the middle of a write.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_requests_stop() -> Iterator[threading.Event]:
    """-> an Event set once SIGTERM arrives while the block runs (the previous handler is restored after).
    Outside the main thread (where Python can't install handlers) the Event is never set."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)
