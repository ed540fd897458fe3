"""SGLang 0.5.23 plugin: rid-keyed hidden-state dumps for extraction. Inert unless EAGLE3_DUMP_DIR is set.

SGLang spawns its scheduler processes, so a monkeypatch in the launching process never reaches
them; the entry point `sglang.srt.plugins` (pyproject.toml) does, in every scheduler process.
Two hooks, on the targets ../shared/reference/sglang-0.5.23.md names (tests pin them to the real
source):

1. BEFORE `GenerationBatchResult.copy_to_cpu`: queue the device-to-host copy of the final hidden
   states right behind the forward, as SGLang does for the aux states; they are views of CUDA-graph
   buffers that the next replay overwrites.
2. REPLACE `SchedulerBatchResultProcessor._append_prefill_hidden_states`, keeping its offset
   contract. For a request that asked for hidden states, on attention-TP rank 0 only, and only for
   prefill rows (decode rows of a mixed batch are skipped): buffer middle chunks of a chunked
   prefill, stitch them at the last chunk, check rows == prompt tokens, and write
   {input_ids, aux [T,3H], final [T,H]} to `<dir>/<sanitized rid>.safetensors` (temp + fsync +
   rename). Nothing is appended to `req.hidden_states`, so no giant JSON response.

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
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic_io import atomic_write

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


class PrefillStitcher:
    """Chunks of one request's prefill, in order, until its last chunk arrives."""

    def __init__(self):
        self.parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, rid: str, aux: torch.Tensor, final: torch.Tensor, last: bool):
        """-> (aux, final) of the whole prompt after the last chunk, else None."""
        self.parts.setdefault(rid, []).append((aux, final))
        if not last:
            return None
        parts = self.parts.pop(rid)
        return torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])

    def drop(self, rid: str) -> None:
        self.parts.pop(rid, None)


class DumpWriter:
    """One writer thread behind a bounded queue: `put` blocks while `max_pending` dumps wait."""

    def __init__(self, dump_dir: Path, max_pending: int = 4):
        self.dir = Path(dump_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="eagle3-dump-writer", daemon=True)
        self.thread.start()

    def put(self, rid: str, input_ids, aux: torch.Tensor, final: torch.Tensor) -> None:
        self.queue.put((rid, torch.as_tensor(list(input_ids), dtype=torch.int32), aux, final))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            rid, ids, aux, final = item
            try:
                tensors = {"input_ids": ids, "aux": aux.contiguous(), "final": final.contiguous()}
                atomic_write(dump_path(self.dir, rid),
                             lambda p, t=tensors, r=rid: save_file(t, str(p), metadata={"rid": str(r)}))
            except Exception:  # noqa: BLE001 -- a failed dump is reported, never kills the scheduler
                self.errors += 1
                log.exception("eagle3: writing the dump of rid %r failed", rid)
            finally:
                self.queue.task_done()


class DumpState:
    """What the hooks share inside one scheduler process."""

    def __init__(self, dump_dir: Path, max_pending: int, is_rank0):
        self.stitcher, self.writer, self.is_rank0 = PrefillStitcher(), DumpWriter(dump_dir, max_pending), is_rank0


_STATE: DumpState | None = None


def append_prefill_hidden_states(self, *, req, logits_output, hidden_state_offset: int, capture_hidden_mode,
                                 extend_input_len: int, store: bool = True) -> int:
    """Replacement of SchedulerBatchResultProcessor._append_prefill_hidden_states (same offsets)."""
    if not capture_hidden_mode.is_full():  # "last" mode: one row per request, nothing to dump
        return hidden_state_offset + 1
    start, end = hidden_state_offset, hidden_state_offset + extend_input_len
    state = _STATE
    if state is None or not req.return_hidden_states or not state.is_rank0():
        return end
    if len(req.output_ids) > 0:  # a decode row in a mixed batch, not prompt rows
        return end
    middle = req.inflight_middle_chunks > 0
    if not middle and not store:  # finished, retracted or discarded: never write a partial prompt
        state.stitcher.drop(req.rid)
        return end
    aux = logits_output.hidden_states[start:end].to("cpu", copy=True)
    final = logits_output.last_hidden_states[start:end].to("cpu", copy=True)
    whole = state.stitcher.add(req.rid, aux, final, last=not middle)
    if whole is None:
        return end
    expected = len(req.origin_input_ids)
    if whole[0].shape[0] != expected or whole[1].shape[0] != expected:
        log.error("eagle3: rid %r has %d aux / %d final rows for %d prompt tokens; not written",
                  req.rid, whole[0].shape[0], whole[1].shape[0], expected)
        return end
    state.writer.put(req.rid, req.origin_input_ids, *whole)
    return end


def copy_final_to_cpu(*args, **kwargs):
    """BEFORE hook of GenerationBatchResult.copy_to_cpu(self, return_logprob, return_hidden_states=True)."""
    self = args[0]
    wants = kwargs.get("return_hidden_states", args[2] if len(args) > 2 else True)
    out = getattr(self, "logits_output", None)
    if _STATE is not None and wants and out is not None and getattr(out, "last_hidden_states", None) is not None:
        from sglang.srt.managers.utils import _async_d2h

        out.last_hidden_states = _async_d2h(out.last_hidden_states)
    return None


def _attn_tp_rank0() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_rank == 0


def register(is_rank0=_attn_tp_rank0) -> bool:
    """Entry point SGLang's load_plugins() calls in each process; registers nothing without the env var."""
    global _STATE
    dump_dir = os.environ.get(ENV_DIR)
    if not dump_dir:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _STATE = DumpState(Path(dump_dir), int(os.environ.get(ENV_QUEUE, "4")), is_rank0)
    HookRegistry.register(COPY_TARGET, copy_final_to_cpu, HookType.BEFORE)
    HookRegistry.register(APPEND_TARGET, append_prefill_hidden_states, HookType.REPLACE)
    log.info("eagle3: hidden-state dumps to %s (queue %d)", dump_dir, _STATE.writer.queue.maxsize)
    return True
