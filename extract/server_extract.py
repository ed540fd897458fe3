"""What extract's server engines share (sglang: our plugin's dumps; vllm: its hidden-states connector's files):
request ids that name the sample and the run, a dump dir kept under a byte budget, a bounded number of requests in
flight, a deadline on every wait, and failures counted by sample.

Rids are `eagle3-<run tag>-<sample hash>`, all of one length: SGLang aborts every request whose rid starts with
an aborted one's, so no rid may be a prefix of another; the run tag keeps a late dump of an earlier run from
being read as this run's. While the dump dir holds more than its budget no new request is sent; files of ours
that no request waits for any more (landed after we gave up, or left by a killed run) are removed. Anything that
fails a check is reported by sample and never written; anything else is a bug and stops the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import stat
import time
from collections import Counter
from pathlib import Path

import httpx

from core.run.errors import UserError
from core.storage.hidden_shards import SampleMismatch

log = logging.getLogger("extract.server")
RID_PREFIX = "eagle3-"
PROBE_IDS = [0, 1, 2, 3]  # token ids every vocabulary has
PROBE_TIMEOUT_S = 30.0


class DumpMismatch(SampleMismatch):
    """The server's answer or dump does not belong to, or does not cover, the sample."""


def dump_dir_bytes(dump_dir: Path) -> int:
    """Bytes of the files in the dump dir. A file listed but gone by the time it is measured (the
    server renaming its temp into place, a consumed dump deleted) is skipped, not an error."""
    total = 0
    for p in Path(dump_dir).iterdir():
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def sample_key(sample_id: str) -> str:
    """The fixed-length part of a rid that names the sample."""
    return hashlib.sha256(sample_id.encode()).hexdigest()[:24]


class ServerExtractor:
    """One engine's client: subclasses say how a request is sent and its dump read (`_one`), whose files are
    theirs (`rid_of_file`), whether a file of theirs may be removed (`removable`) and what the server is
    called in messages (`engine`)."""
    engine = "server"
    launcher = "scripts/launch_<engine>_extract.sh"

    def __init__(self, server_url: str, dump_dir: Path, max_inflight: int, dump_budget_bytes: int,
                 request_timeout: float, dump_timeout: float):
        self.root = server_url.rstrip("/")
        self.dump_dir, self.budget = Path(dump_dir), dump_budget_bytes
        self.max_inflight, self.request_timeout, self.dump_timeout = max_inflight, request_timeout, dump_timeout
        self.run_tag = secrets.token_hex(4)
        self.waiting: set[str] = set()  # rids whose dump a request still waits for
        self.failures: Counter[str] = Counter()
        self.paused_s = 0.0

    def rid(self, sample_id: str) -> str:
        return f"{RID_PREFIX}{self.run_tag}-{sample_key(sample_id)}"

    def rid_of_file(self, name: str) -> str | None:
        raise NotImplementedError

    def removable(self, path: Path, now: float) -> bool:
        """Whether a file of ours that no request waits for may go (not while its writer may still write)."""
        raise NotImplementedError

    def clear_stale_dumps(self) -> int:
        """Remove files of ours that nobody will read: those no request waits for (left by an earlier run, or
        landed after we gave up on them) whose writer is done. Anything not ours is left alone."""
        removed, now = 0, time.time()
        for p in list(self.dump_dir.iterdir()) if self.dump_dir.is_dir() else []:
            rid = self.rid_of_file(p.name)
            if rid is None or rid in self.waiting:
                continue
            try:
                if not self.removable(p, now):
                    continue
                p.unlink()
            except FileNotFoundError:  # renamed into place or consumed meanwhile
                continue
            removed += 1
        return removed

    async def _wait_for_budget(self, rid: str) -> None:
        start = None
        while dump_dir_bytes(self.dump_dir) > self.budget:
            if start is None:
                start = time.monotonic()
                log.warning("dump dir %s over its %.0f MB budget: pausing new requests", self.dump_dir, self.budget / 2**20)
            if n := self.clear_stale_dumps():
                log.warning("removed %d dumps nobody waits for (given up on, or left by a killed run)", n)
                continue
            if time.monotonic() - start > 2 * self.dump_timeout:  # a temp is stale one dump timeout after its last write
                raise UserError(f"rid {rid} waited {2 * self.dump_timeout:.0f} s for the dump dir {self.dump_dir} to fall "
                                f"below its {self.budget / 2**20:.0f} MB budget (extract.dump_budget_mb): it holds "
                                f"{dump_dir_bytes(self.dump_dir) / 2**20:.1f} MB of files that are not ours or are "
                                "still being written; free the dir or raise the budget")
            await asyncio.sleep(0.05)
        if start is not None:
            self.paused_s += time.monotonic() - start

    async def _wait_ready(self, client: httpx.AsyncClient) -> None:
        """GET /health until the server answers 200 (it may still be loading weights or warming up)."""
        deadline = time.monotonic() + self.request_timeout
        while True:
            try:
                if (await client.get(self.root + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"{self.engine} server at {self.root} not healthy after {self.request_timeout:.0f} s "
                                f"(start it with {self.launcher})")
            await asyncio.sleep(1.0)

    async def _one(self, client: httpx.AsyncClient, rid: str, input_ids: list[int], dump_timeout: float):
        """(the ids the server ran, aux [T,3H], final [T,H]) of one request, or DumpMismatch saying why not."""
        raise NotImplementedError

    async def _probe(self, client: httpx.AsyncClient) -> None:
        """A tiny request whose dump must appear: proves the server writes dumps where we read them."""
        rid = self.rid("\0probe")  # sample ids never hold a NUL
        try:
            ids, _, _ = await self._one(client, rid, PROBE_IDS, min(self.dump_timeout, PROBE_TIMEOUT_S))
        except (SampleMismatch, httpx.HTTPError) as e:
            raise UserError(f"probe request to {self.root} failed: {e}. {self.probe_hint()}") from None
        if ids.tolist() != PROBE_IDS:
            raise UserError(f"probe dump {rid} holds ids {ids.tolist()}, not the {PROBE_IDS} sent")

    def probe_hint(self) -> str:
        return f"Start the server with {self.launcher}"

    async def prepare(self, client: httpx.AsyncClient) -> None:
        """Anything to learn from the server before the probe (its model name, ...)."""

    async def run(self, samples, on_result) -> None:
        """samples: iterable of (sample_id, input_ids, extra); on_result(sample_id, extra, seen_ids, aux, final)
        validates and keeps a sample; a SampleMismatch from it (or from the checks here) is a counted failure."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        queue = iter(samples)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout)) as client:
            await self._wait_ready(client)
            await self.prepare(client)
            await self._probe(client)

            async def worker():
                for sample_id, input_ids, extra in queue:
                    rid = self.rid(sample_id)
                    await self._wait_for_budget(rid)
                    try:
                        on_result(sample_id, extra, *await self._one(client, rid, input_ids, self.dump_timeout))
                    except (SampleMismatch, httpx.HTTPError) as e:
                        self.failures[type(e).__name__] += 1
                        log.error("sample %s not extracted: %s", sample_id, e)

            await asyncio.gather(*(worker() for _ in range(self.max_inflight)))
