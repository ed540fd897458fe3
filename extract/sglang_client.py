"""extract `sglang` engine: drive a plugin-patched SGLang server (scripts/launch_sglang_extract.sh).

First a probe request proves that the plugin is live in the server's scheduler (its dump must appear
within PROBE_TIMEOUT_S); SGLang swallows plugin errors, and a server without the plugin answers
normally, so without the probe every sample would wait out its dump timeout. Then per sample:
POST /generate {"rid", "input_ids", "return_hidden_states": true, "sampling_params":
{"max_new_tokens": 1, "temperature": 0}}; check meta_info (id == rid, prompt_tokens == len(ids),
cached_tokens == 0: a prefix-cache hit means rows were never computed); wait for the plugin's
`<dump_dir>/<rid>.safetensors` (or its `.failed` file, which says why there is none); check its
token ids and row counts; hand aux/final to the shard writer; delete the dump.

Rids are `eagle3-<run tag>-<sample hash>`, all of one length: SGLang aborts every request whose rid
starts with an aborted one's, so no rid may be a prefix of another; the run tag keeps a late dump of
an earlier run from being read as this run's. In-flight requests are bounded, and while the dump dir
holds more than its byte budget no new request is sent; dumps and failure files of ours that no
request waits for any more (landed after we gave up), and temps no writer touched for a dump timeout
(a server killed mid-write), are removed. Every wait has a deadline. Anything that fails a check is
reported by sample and never written; anything else is a bug and stops the run.
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
from safetensors import SafetensorError
from safetensors.torch import load_file

from core.errors import UserError
from core.hidden_shards import SampleMismatch
from extract.sglang_plugin import dump_path, failure_path

log = logging.getLogger("extract.sglang")
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


def rid_of_file(name: str) -> str | None:
    """The rid a dump-dir file belongs to if it is one of ours (dump, failure file or the plugin's
    temp `.<dump>.tmp<pid>`), else None."""
    final = name.lstrip(".").split(".", 1)[0]
    return final if final.startswith(RID_PREFIX) else None


def check_meta(meta: dict, rid: str, n_tokens: int) -> None:
    if meta.get("id") != rid:
        raise DumpMismatch(f"meta_info.id {meta.get('id')!r} != rid {rid!r}")
    if meta.get("prompt_tokens") != n_tokens:
        raise DumpMismatch(f"prompt_tokens {meta.get('prompt_tokens')} != {n_tokens} sent")
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":  # its prefill stopped: no dump is coming
        raise DumpMismatch(f"rid {rid}: aborted by the server: {reason.get('message')}")
    if meta.get("cached_tokens", 0) != 0:
        raise DumpMismatch(f"cached_tokens = {meta['cached_tokens']}: prefix-cache hit, rows never computed "
                           "(launch with --disable-radix-cache)")


def read_dump(path: Path):
    """(token ids, aux, final) of a plugin dump; the shard writer's check_sample then holds them
    against the sample (same tokens, one row each), exactly as it does for the hf engine."""
    try:
        t = load_file(str(path))
        ids, aux, final = t["input_ids"], t["aux"], t["final"]
    except (SafetensorError, KeyError) as e:
        raise DumpMismatch(f"unreadable dump {path.name}: {type(e).__name__}: {e}") from None
    if not aux.shape[0] == final.shape[0] == ids.shape[0]:
        raise DumpMismatch(f"dump {path.name}: {aux.shape[0]} aux / {final.shape[0]} final rows for {ids.shape[0]} ids")
    return ids, aux, final


class SGLangExtractor:
    def __init__(self, server_url: str, dump_dir: Path, max_inflight: int, dump_budget_bytes: int,
                 request_timeout: float, dump_timeout: float):
        self.root = server_url.rstrip("/")
        self.url = self.root + "/generate"
        self.dump_dir, self.budget = Path(dump_dir), dump_budget_bytes
        self.max_inflight, self.request_timeout, self.dump_timeout = max_inflight, request_timeout, dump_timeout
        self.run_tag = secrets.token_hex(4)
        self.waiting: set[str] = set()  # rids whose dump a request still waits for
        self.failures: Counter[str] = Counter()
        self.paused_s = 0.0

    def rid(self, sample_id: str) -> str:
        return f"{RID_PREFIX}{self.run_tag}-{sample_key(sample_id)}"

    def clear_stale_dumps(self) -> int:
        """Remove files of ours that nobody will read: dumps and failure files no request waits for
        (left by an earlier run, or landed after we gave up on them), and temps untouched for a dump
        timeout (their writer died). Temps being written and anything not ours are left alone."""
        removed, now = 0, time.time()
        for p in list(self.dump_dir.iterdir()) if self.dump_dir.is_dir() else []:
            rid = rid_of_file(p.name)
            if rid is None or rid in self.waiting:
                continue
            try:
                if p.name.startswith(".") and now - p.stat().st_mtime < self.dump_timeout:
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
                raise UserError(f"SGLang server at {self.root} not healthy after {self.request_timeout:.0f} s "
                                "(start it with scripts/launch_sglang_extract.sh)")
            await asyncio.sleep(1.0)

    async def _wait_for_dump(self, rid: str, timeout: float):
        """The dump of `rid` once the plugin committed it; DumpMismatch with the plugin's reason if it
        wrote a failure file instead, or naming the rid and the file if neither came within `timeout`."""
        path, failed = dump_path(self.dump_dir, rid), failure_path(self.dump_dir, rid)
        deadline = time.monotonic() + timeout
        while not path.exists():
            if failed.exists():
                reason = failed.read_text().strip()
                failed.unlink(missing_ok=True)
                raise DumpMismatch(f"rid {rid}: the server wrote no dump: {reason}")
            if time.monotonic() > deadline:
                raise DumpMismatch(f"rid {rid}: no dump {path.name} in {self.dump_dir} within {timeout:.0f} s "
                                   "of the server's answer")
            await asyncio.sleep(0.01)
        try:
            return read_dump(path)
        finally:
            path.unlink(missing_ok=True)

    async def _one(self, client: httpx.AsyncClient, rid: str, input_ids: list[int], dump_timeout: float):
        body = {"rid": rid, "input_ids": list(input_ids), "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        self.waiting.add(rid)
        try:
            resp = await client.post(self.url, json=body)
            if resp.status_code != 200:
                raise DumpMismatch(f"rid {rid}: HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                meta = resp.json().get("meta_info") or {}
            except ValueError:
                raise DumpMismatch(f"rid {rid}: answer is not JSON: {resp.text[:200]}") from None
            check_meta(meta, rid, len(input_ids))
            return await self._wait_for_dump(rid, dump_timeout)
        finally:
            self.waiting.discard(rid)

    async def _probe(self, client: httpx.AsyncClient) -> None:
        """A tiny request whose dump must appear: proves the plugin is live and writing to our dump dir."""
        rid = self.rid("\0probe")  # sample ids never hold a NUL
        try:
            ids, _, _ = await self._one(client, rid, PROBE_IDS, min(self.dump_timeout, PROBE_TIMEOUT_S))
        except (SampleMismatch, httpx.HTTPError) as e:
            raise UserError(f"probe request to {self.url} failed: {e}. The eagle3 plugin is not dumping into "
                            f"{self.dump_dir}: start the server with scripts/launch_sglang_extract.sh (it sets "
                            "EAGLE3_DUMP_DIR to this dir, keeps eagle3_hidden_dump in SGLANG_PLUGINS and refuses "
                            "--disaggregation-mode prefill), and look in its log for 'eagle3' errors") from None
        if ids.tolist() != PROBE_IDS:
            raise UserError(f"probe dump {rid} holds ids {ids.tolist()}, not the {PROBE_IDS} sent")

    async def run(self, samples, on_result) -> None:
        """samples: iterable of (sample_id, input_ids, extra); on_result(sample_id, extra, seen_ids, aux, final)
        validates and keeps a sample; a SampleMismatch from it (or from the checks here) is a counted failure."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        queue = iter(samples)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout)) as client:
            await self._wait_ready(client)
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
