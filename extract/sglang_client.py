"""extract `sglang` engine: drive a plugin-patched SGLang server (scripts/launch_sglang_extract.sh).

Per sample: POST /generate {"rid", "input_ids", "return_hidden_states": true, "sampling_params":
{"max_new_tokens": 1, "temperature": 0}}; check meta_info (id == rid, prompt_tokens == len(ids),
cached_tokens == 0: a prefix-cache hit means rows were never computed); wait for the plugin's
`<dump_dir>/<rid>.safetensors`; check its token ids and row counts; hand aux/final to the shard
writer; delete the dump. Dumps are keyed by our rid, so warmups, health checks and overlapping
batches can't be matched to the wrong sample. In-flight requests are bounded, and while the dump
dir holds more than its byte budget no new request is sent (the consumer never falls behind
unboundedly). Anything that fails a check is reported by sample and never written.
"""

from __future__ import annotations

import asyncio
import logging
import stat
import time
from collections import Counter
from pathlib import Path

import httpx
from safetensors.torch import load_file

from core.hidden_shards import SampleMismatch
from extract.sglang_plugin import dump_path

log = logging.getLogger("extract.sglang")
RID_PREFIX = "eagle3-"


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


def check_meta(meta: dict, rid: str, n_tokens: int) -> None:
    if meta.get("id") != rid:
        raise DumpMismatch(f"meta_info.id {meta.get('id')!r} != rid {rid!r}")
    if meta.get("prompt_tokens") != n_tokens:
        raise DumpMismatch(f"prompt_tokens {meta.get('prompt_tokens')} != {n_tokens} sent")
    if meta.get("cached_tokens", 0) != 0:
        raise DumpMismatch(f"cached_tokens = {meta['cached_tokens']}: prefix-cache hit, rows never computed "
                           "(launch with --disable-radix-cache)")


def read_dump(path: Path):
    """(token ids, aux, final) of a plugin dump; the shard writer's check_sample then holds them
    against the sample (same tokens, one row each), exactly as it does for the hf engine."""
    t = load_file(str(path))
    return t["input_ids"], t["aux"], t["final"]


class SGLangExtractor:
    def __init__(self, server_url: str, dump_dir: Path, max_inflight: int, dump_budget_bytes: int,
                 request_timeout: float, dump_timeout: float):
        self.root = server_url.rstrip("/")
        self.url = self.root + "/generate"
        self.dump_dir, self.budget = Path(dump_dir), dump_budget_bytes
        self.max_inflight, self.request_timeout, self.dump_timeout = max_inflight, request_timeout, dump_timeout
        self.failures: Counter[str] = Counter()
        self.paused_s = 0.0

    def clear_stale_dumps(self) -> int:
        """Dumps of ours left by a killed run (their samples are redone); they would count against the budget."""
        stale = list(self.dump_dir.glob(f"{RID_PREFIX}*.safetensors"))
        for p in stale:
            p.unlink(missing_ok=True)
        return len(stale)

    async def _wait_for_budget(self) -> None:
        start = None
        while dump_dir_bytes(self.dump_dir) > self.budget:
            if start is None:
                start = time.monotonic()
                log.warning("dump dir %s over its %.0f MB budget: pausing new requests", self.dump_dir, self.budget / 2**20)
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
                raise ValueError(f"SGLang server at {self.root} not healthy after {self.request_timeout:.0f} s "
                                 "(start it with scripts/launch_sglang_extract.sh)")
            await asyncio.sleep(1.0)

    async def _one(self, client: httpx.AsyncClient, sample_id: str, input_ids: list[int]):
        rid = RID_PREFIX + sample_id
        path = dump_path(self.dump_dir, rid)
        body = {"rid": rid, "input_ids": list(input_ids), "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        resp = await client.post(self.url, json=body)
        if resp.status_code != 200:
            raise DumpMismatch(f"HTTP {resp.status_code}: {resp.text[:200]}")
        check_meta(resp.json().get("meta_info") or {}, rid, len(input_ids))
        deadline = time.monotonic() + self.dump_timeout
        while not path.exists():  # the plugin's writer thread may still be committing it
            if time.monotonic() > deadline:
                raise DumpMismatch(f"no dump {path.name} within {self.dump_timeout:.0f} s of the response")
            await asyncio.sleep(0.01)
        try:
            return read_dump(path)
        finally:
            path.unlink(missing_ok=True)

    async def run(self, samples, on_result) -> None:
        """samples: iterable of (sample_id, input_ids, extra); on_result(sample_id, extra, seen_ids, aux, final)
        validates and keeps a sample; a SampleMismatch from it (or from the checks here) is a counted failure."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        queue = iter(samples)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout)) as client:
            await self._wait_ready(client)

            async def worker():
                for sample_id, input_ids, extra in queue:
                    await self._wait_for_budget()
                    try:
                        on_result(sample_id, extra, *await self._one(client, sample_id, input_ids))
                    except (SampleMismatch, httpx.HTTPError, KeyError, ValueError) as e:
                        self.failures[type(e).__name__] += 1
                        log.error("sample %s not extracted: %s", sample_id, e)

            await asyncio.gather(*(worker() for _ in range(self.max_inflight)))
