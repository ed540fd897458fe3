"""SGLang 0.5.23 plugin: rid-keyed hidden-state dumps for extraction. Inert unless EAGLE3_DUMP_DIR is set.

SGLang spawns its scheduler processes, so a monkeypatch in the launching process never reaches
them; the entry point `sglang.srt.plugins` (pyproject.toml) does. SGLang also loads plugins in its
HTTP server, detokenizer and DP controller, and in a scheduler before its ranks are published, so
`register` only records the hooks: the writer thread and dump dir are made at the first hook call
on a writing rank (the attention group leader, SGLang's own `attn_tp_rank == 0 and attn_cp_rank
== 0`). Two hooks, on these targets of SGLang 0.5.23's source (tests pin them to
the real source):

1. BEFORE `GenerationBatchResult.copy_to_cpu`: queue the device-to-host copy of the final hidden
   states right behind the forward, as SGLang does for the aux states; they are views of CUDA-graph
   buffers that the next replay overwrites.
2. REPLACE `SchedulerBatchResultProcessor._append_prefill_hidden_states`, keeping its offset
   contract. For a request that asked for hidden states, only for prefill rows (decode rows of a
   mixed batch are skipped): buffer middle chunks of a chunked prefill (keyed by the Req object,
   dropped when it finishes, aborts or is freed), stitch them at the last chunk, check aux rows ==
   final rows == prompt tokens, and write {input_ids, aux [T,3H], final [T,H]} to
   `<dir>/<sanitized rid>.safetensors` (temp + fsync + rename). A request that cannot be dumped
   gets `<dir>/<sanitized rid>.failed` holding the reason instead, so the client never waits blind.
   Nothing is appended to `req.hidden_states`, so no giant JSON response.

Writes go through a bounded queue (EAGLE3_DUMP_QUEUE, default 4): when the disk falls behind,
`put` blocks the scheduler instead of filling memory. Warmup requests don't ask for hidden states
and health checks use rid prefix HEALTH_CHECK_, so neither can produce or shadow a dump.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import threading
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.storage.atomic_io import atomic_write, atomic_write_text

log = logging.getLogger("eagle3.sglang_plugin")

ENV_DIR, ENV_QUEUE = "EAGLE3_DUMP_DIR", "EAGLE3_DUMP_QUEUE"
COPY_TARGET = "sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu"
APPEND_TARGET = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                 "SchedulerBatchResultProcessor._append_prefill_hidden_states")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def sanitize_rid(rid: object) -> str:
    """A file-name-safe, collision-free name for a request id: safe characters kept, the rest
    replaced, plus a hash of the original whenever anything was changed (so "a/b" != "a_b")."""
    text = str(rid)
    safe = _SAFE.sub("_", text)[:96].lstrip(".")
    if safe != text or not safe:
        safe = f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return safe


def dump_path(dump_dir: Path, rid: object) -> Path:
    return Path(dump_dir) / f"{sanitize_rid(rid)}.safetensors"


def failure_path(dump_dir: Path, rid: object) -> Path:
    """Where the plugin says why a request has no dump (one line of text)."""
    return Path(dump_dir) / f"{sanitize_rid(rid)}.failed"


class PrefillStitcher:
    """Chunks of the prompts being prefilled, until each one's last chunk arrives. Keyed weakly by the
    Req object: a rerun of a rid is a new Req that never sees an old one's chunks, and the chunks of
    a Req SGLang drops without another hook call (aborted between chunks) go with it."""

    def __init__(self):
        self.parts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self.parts)

    def add(self, req, aux: torch.Tensor, final: torch.Tensor, last: bool):
        """-> (aux, final) of the whole prompt after the last chunk, else None."""
        self.parts.setdefault(req, []).append((aux, final))
        if not last:
            return None
        parts = self.parts.pop(req)
        return torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])

    def drop(self, req) -> None:
        self.parts.pop(req, None)


class DumpWriter:
    """One writer thread behind a bounded queue: `put` blocks while `max_pending` dumps wait. A dump
    that fails to write leaves its failure file, never an exception in the scheduler."""

    def __init__(self, dump_dir: Path, max_pending: int = 4):
        self.dir = Path(dump_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.thread = threading.Thread(target=self._run, name="eagle3-dump-writer", daemon=True)
        self.thread.start()

    def put(self, rid: str, input_ids, aux: torch.Tensor, final: torch.Tensor) -> None:
        self.queue.put((rid, (torch.as_tensor(list(input_ids), dtype=torch.int32), aux, final)))

    def fail(self, rid: str, reason: str) -> None:
        log.error("eagle3: no dump for rid %r: %s", rid, reason)
        self.queue.put((rid, reason))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            rid, payload = item
            try:
                if isinstance(payload, str):
                    self._report(rid, payload)
                else:
                    self._write(rid, *payload)
            except Exception as e:  # noqa: BLE001 -- a failed dump is reported, never kills the scheduler
                log.exception("eagle3: writing the dump of rid %r failed", rid)
                self._report(rid, f"writing the dump failed on the server: {type(e).__name__}: {e}")
            finally:
                self.queue.task_done()

    def _write(self, rid: str, ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> None:
        tensors = {"input_ids": ids, "aux": aux.contiguous(), "final": final.contiguous()}
        atomic_write(dump_path(self.dir, rid), lambda p: save_file(tensors, str(p), metadata={"rid": str(rid)}))

    def _report(self, rid: str, reason: str) -> None:
        try:
            atomic_write_text(failure_path(self.dir, rid), reason + "\n")
        except OSError:
            log.exception("eagle3: could not record why rid %r has no dump", rid)


class DumpState:
    """The stitcher and writer of one writing rank."""

    def __init__(self, dump_dir: Path, max_pending: int):
        self.stitcher, self.writer = PrefillStitcher(), DumpWriter(dump_dir, max_pending)

    def take(self, req, out, start: int, end: int, store: bool) -> None:
        """Rows [start, end) of batch output `out` are prompt rows of `req`: buffer, stitch, write."""
        middle = req.inflight_middle_chunks > 0
        if req.finished() or (not middle and not store):  # aborted, retracted or discarded: no partial prompt
            self.stitcher.drop(req)
            return
        aux_rows, final = out.hidden_states, out.last_hidden_states
        if final is None or final.shape[0] != aux_rows.shape[0]:
            self.stitcher.drop(req)
            self.writer.fail(req.rid, "the batch has no final hidden states aligned with its aux rows (aux "
                             f"{tuple(aux_rows.shape)}, final {None if final is None else tuple(final.shape)}): "
                             "start the server with --enable-return-aux-hidden-states")
            return
        whole = self.stitcher.add(req, aux_rows[start:end].to("cpu", copy=True), final[start:end].to("cpu", copy=True),
                                  last=not middle)
        if whole is None:
            return
        n_aux, n_final, expected = whole[0].shape[0], whole[1].shape[0], len(req.origin_input_ids)
        if n_aux != expected or n_final != expected:
            self.writer.fail(req.rid, f"{n_aux} aux / {n_final} final rows for {expected} prompt tokens")
            return
        self.writer.put(req.rid, req.origin_input_ids, *whole)


class Plugin:
    """What the hooks share inside one process. The rank is asked at the first hook call (SGLang
    publishes it after loading plugins); the writer exists only on the writing rank."""

    def __init__(self, dump_dir: Path, max_pending: int, is_writer):
        self.dump_dir, self.max_pending, self.is_writer = Path(dump_dir), max_pending, is_writer
        self.writing: bool | None = None
        self.state: DumpState | None = None

    def writer_state(self) -> DumpState | None:
        if self.writing is None:
            self.writing = bool(self.is_writer())
        if self.writing and self.state is None:
            self.state = DumpState(self.dump_dir, self.max_pending)
            log.info("eagle3: hidden-state dumps to %s (queue %d)", self.dump_dir, self.max_pending)
        return self.state

    def close(self) -> None:
        if self.state is not None:
            self.state.writer.close()


_PLUGIN: Plugin | None = None


def append_prefill_hidden_states(self, *, req, logits_output, hidden_state_offset: int, capture_hidden_mode,
                                 extend_input_len: int, store: bool = True) -> int:
    """Replacement of SchedulerBatchResultProcessor._append_prefill_hidden_states (same offsets)."""
    if not capture_hidden_mode.is_full():  # "last" mode: one row per request, nothing to dump
        return hidden_state_offset + 1
    start, end = hidden_state_offset, hidden_state_offset + extend_input_len
    if _PLUGIN is None or not req.return_hidden_states or len(req.output_ids) > 0:  # decode rows: not prompt rows
        return end
    state = _PLUGIN.writer_state()
    if state is not None:
        state.take(req, logits_output, start, end, store)
    return end


def copy_final_to_cpu(*args, **kwargs):
    """BEFORE hook of GenerationBatchResult.copy_to_cpu(self, return_logprob, return_hidden_states=True)."""
    self = args[0]
    wants = kwargs.get("return_hidden_states", args[2] if len(args) > 2 else True)
    out = getattr(self, "logits_output", None)
    if not wants or out is None or getattr(out, "last_hidden_states", None) is None:
        return None
    if _PLUGIN is not None and _PLUGIN.writer_state() is not None:  # other ranks never read the rows
        from sglang.srt.managers.utils import _async_d2h

        out.last_hidden_states = _async_d2h(out.last_hidden_states)
    return None


def is_attn_group_leader() -> bool:
    """SGLang's own test for the rank that receives a DP group's requests (request_receiver.py)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0


def register(is_writer=is_attn_group_leader) -> bool:
    """Entry point SGLang's load_plugins() calls in each process; registers nothing without the env var."""
    global _PLUGIN
    dump_dir = os.environ.get(ENV_DIR)
    if not dump_dir:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _PLUGIN = Plugin(Path(dump_dir), int(os.environ.get(ENV_QUEUE, "4")), is_writer)
    HookRegistry.register(COPY_TARGET, copy_final_to_cpu, HookType.BEFORE)
    HookRegistry.register(APPEND_TARGET, append_prefill_hidden_states, HookType.REPLACE)
    return True
