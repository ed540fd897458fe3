"""One pool of pending requests across parts, so every in-process (`hf`) call is a full batch.

Answering a part turn by turn leaves the later turns as ever smaller calls, each still as many decode
steps long as its longest answer. Here a call takes the `batch_size` pending requests of the earliest
parts, the pool is topped up with the next part's first requests whenever it holds fewer, and parts
are committed in order, each once all its conversations (and those of every earlier part) are done:
what a kill leaves on disk is still whole parts, so resume is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

C = TypeVar("C")  # a conversation
Q = TypeVar("Q")  # a request
A = TypeVar("A")  # its answer


def answer_parts(parts: Sequence[Sequence[C]], batch_size: int, advance: Callable[[C, A | None], Q | None],
                 answer: Callable[[list[Q]], list[A]], commit: Callable[[Sequence[C]], None],
                 stop: Callable[[], bool] = lambda: False) -> bool:
    """advance(conv, answer or None at the start) records the answer and returns the conversation's next
    request, or None when it is finished; answer(requests) -> their answers, at most batch_size per call;
    commit(part) is called for each part, in order. stop() is asked before each call: once it says yes,
    the conversations already finished in the parts still open are committed together (their rows are
    kept, the parts' grouping is not; a rerun skips them by id) -> False. True when every part is done."""
    pending: list[tuple[int, C, Q]] = []  # (part index, conversation, request)
    running = [len(p) for p in parts]  # conversations of each part not finished yet
    admitted = committed = 0

    def step(part: int, conv: C, reply: A | None) -> None:
        request = advance(conv, reply)
        if request is None:
            running[part] -= 1
        else:
            pending.append((part, conv, request))

    while True:
        while len(pending) < batch_size and admitted < len(parts):
            for conv in parts[admitted]:
                step(admitted, conv, None)
            admitted += 1
        while committed < admitted and running[committed] == 0:
            commit(parts[committed])
            committed += 1
        if not pending:
            assert committed == len(parts), (committed, len(parts))
            return True
        if stop():
            waiting = {id(conv) for _, conv, _ in pending}
            finished = [conv for p in parts[committed:admitted] for conv in p if id(conv) not in waiting]
            if finished:
                commit(finished)
            return False
        pending.sort(key=lambda r: r[0])  # stable: earliest parts first, so parts finish roughly in order
        call = pending[:batch_size]
        del pending[:batch_size]
        for (part, conv, _), reply in zip(call, answer([r for _, _, r in call]), strict=True):
            step(part, conv, reply)
