"""extract `sglang` engine: drive a plugin-patched SGLang server (scripts/launch_sglang_extract.sh).

First a probe request proves that the plugin is live in the server's scheduler (its dump must appear
within PROBE_TIMEOUT_S); SGLang swallows plugin errors, and a server without the plugin answers
normally, so without the probe every sample would wait out its dump timeout. Then per sample:
POST /generate {"rid", "input_ids", "return_hidden_states": true, "sampling_params":
{"max_new_tokens": 1, "temperature": 0}}; check meta_info (id == rid, prompt_tokens == len(ids),
cached_tokens == 0: a prefix-cache hit means rows were never computed); wait for the plugin's
`<dump_dir>/<rid>.safetensors` (or its `.failed` file, which says why there is none); check its
token ids and row counts; hand aux/final to the shard writer; delete the dump.

Rids, the dump dir's budget, deadlines and failure counts: extract/server_extract.py. Temps no writer touched for a
dump timeout (a server killed mid-write) count as stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx
from safetensors import SafetensorError
from safetensors.torch import load_file

from extract.server_extract import RID_PREFIX, DumpMismatch, ServerExtractor
from extract.sglang_plugin import dump_path, failure_path

log = logging.getLogger("extract.sglang")


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


class SGLangExtractor(ServerExtractor):
    engine, launcher = "SGLang", "scripts/launch_sglang_extract.sh"

    def rid_of_file(self, name: str) -> str | None:
        """The rid a dump-dir file belongs to if it is one of ours (dump, failure file or the plugin's temp
        `.<dump>.tmp<pid>`), else None."""
        final = name.lstrip(".").split(".", 1)[0]
        return final if final.startswith(RID_PREFIX) else None

    def removable(self, path: Path, now: float) -> bool:
        """A dump or failure file at once; a temp once its writer has been silent for a dump timeout."""
        return not path.name.startswith(".") or now - path.stat().st_mtime >= self.dump_timeout

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
            resp = await client.post(self.root + "/generate", json=body)
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

    def probe_hint(self) -> str:
        return (f"The eagle3 plugin is not dumping into {self.dump_dir}: start the server with {self.launcher} (it "
                "sets EAGLE3_DUMP_DIR to this dir, keeps eagle3_hidden_dump in SGLANG_PLUGINS and refuses "
                "--disaggregation-mode prefill), and look in its log for 'eagle3' errors")
