"""extract `vllm` engine: drive a stock vLLM 0.33 server started by scripts/launch_vllm_extract.sh (no patch).

Its `extract_hidden_states` method and `ExampleHiddenStatesConnector` (core/target/vllm_extract.py) write, per request,
`<dump_dir>/cmpl-<rid>-0[-<8 hex>].safetensors`: `hidden_states` [T, 4, H] (the three aux layers and the last
layer's output before the final norm) and `token_ids` [T]. The writer pre-creates `<file>.lock` and holds an
exclusive flock on it until the file is complete; its path comes back in the response's
`kv_transfer_params.hidden_states_path`.

Before anything is sent, the layer ids the launcher recorded in the dump dir must be this run's (a server
launched for other layers would answer normally). A probe request proves the connector writes where we read.
Then per sample: POST /v1/completions {"prompt": ids, "max_tokens": 1, "return_token_ids": true} with
`X-Request-Id: <rid>`; the answer's id must be `cmpl-<rid>`, its `prompt_token_ids` the ids sent, its path a file
of that rid (only the name is used: a path elsewhere is never read or removed); the file is read under a shared
lock, only once the writer released its own, its `token_ids` and row count checked; then file and lock are
removed. Every wait has a deadline; a failed check names the sample and writes nothing.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import time
from pathlib import Path

import httpx
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from core.run.errors import UserError
from core.target.vllm_extract import LAUNCH_FILE
from extract.server_extract import RID_PREFIX, DumpMismatch, ServerExtractor

_RID_LEN = len(RID_PREFIX) + 8 + 1 + 24  # eagle3-<run tag>-<sample key>
_OURS = re.compile(rf"cmpl-({re.escape(RID_PREFIX)}[0-9a-f]{{8}}-[0-9a-f]{{24}})-\d+(-[0-9a-f]+)?\.safetensors(\.lock)?")


def final_norm(last: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm over the last layer's output (transformers' Llama / DeepSeek-V3 order: fp32
    statistics, the weight applied in the states' dtype): the `final` the hf engine stores."""
    x = last.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(last.dtype) * x.to(last.dtype)


class VLLMExtractor(ServerExtractor):
    engine, launcher = "vLLM", "scripts/launch_vllm_extract.sh"

    def __init__(self, *args, layer_ids: list[int], hidden_size: int, norm_weight: torch.Tensor, norm_eps: float,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_ids, self.hidden_size = layer_ids, hidden_size
        self.norm_weight, self.norm_eps = norm_weight, norm_eps
        self.model = ""

    def rid_of_file(self, name: str) -> str | None:
        m = _OURS.fullmatch(name)
        return m.group(1) if m else None

    def removable(self, path: Path, now: float) -> bool:
        """Not while the server holds the file's lock (it is still writing it)."""
        lock = path if path.name.endswith(".lock") else path.with_name(path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    async def prepare(self, client: httpx.AsyncClient) -> None:
        """The layer ids the server was launched with must be ours; the model name it serves is what we ask for."""
        launch = self.dump_dir / LAUNCH_FILE
        try:
            recorded = json.loads(launch.read_text())["layer_ids"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"{launch}: missing or unreadable, so the layers the vLLM server captures are unknown: "
                            f"start it with {self.launcher} and this run's config, writing into {self.dump_dir} "
                            "(extract.dump_dir)") from None
        if recorded != self.layer_ids:
            raise UserError(f"{launch}: the vLLM server was launched to capture layer ids {recorded}, this run needs "
                            f"{self.layer_ids} (extract.aux_layers + the last layer): relaunch it with this config")
        resp = await client.get(self.root + "/v1/models")
        try:
            self.model = resp.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise UserError(f"{self.root}/v1/models: HTTP {resp.status_code}, no model listed: {resp.text[:200]}") from None

    async def _one(self, client: httpx.AsyncClient, rid: str, input_ids: list[int], dump_timeout: float):
        body = {"model": self.model, "prompt": list(input_ids), "max_tokens": 1, "temperature": 0,
                "return_token_ids": True}
        self.waiting.add(rid)
        try:
            resp = await client.post(self.root + "/v1/completions", json=body, headers={"X-Request-Id": rid})
            if resp.status_code != 200:
                raise DumpMismatch(f"rid {rid}: HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                answer = resp.json()
            except ValueError:
                raise DumpMismatch(f"rid {rid}: answer is not JSON: {resp.text[:200]}") from None
            path = self._file_of(answer, rid, list(input_ids))
            return self._split(await self._read_unlocked(path, rid, dump_timeout), rid, list(input_ids))
        finally:
            self.waiting.discard(rid)

    def _file_of(self, answer: dict, rid: str, input_ids: list[int]) -> Path:
        """The dump file the answer names, in our dump dir, after the answer's own checks."""
        if answer.get("id") != f"cmpl-{rid}":
            raise DumpMismatch(f"rid {rid}: the answer is request {answer.get('id')!r}, not cmpl-{rid}")
        choice = (answer.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") != input_ids:
            got = choice.get("prompt_token_ids")
            raise DumpMismatch(f"rid {rid}: the server ran other token ids ({len(got or [])} of them, not the "
                               f"{len(input_ids)} sent)" if got is not None else
                               f"rid {rid}: no prompt_token_ids in the answer (return_token_ids ignored)")
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not isinstance(path, str):
            raise DumpMismatch(f"rid {rid}: no kv_transfer_params.hidden_states_path in the answer: the server runs "
                               f"without the hidden-states connector (start it with {self.launcher})")
        name = Path(path).name
        if self.rid_of_file(name) != rid or name.endswith(".lock"):
            raise DumpMismatch(f"rid {rid}: the answer names {name!r}, not a file of this request")
        return self.dump_dir / name

    async def _read_unlocked(self, path: Path, rid: str, timeout: float) -> dict[str, torch.Tensor]:
        """The file's tensors, read under a shared lock once the writer released its exclusive one; then file and
        lock are removed."""
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + timeout
        while not lock.exists():  # created before the server answers: its absence means no lock is coming
            if time.monotonic() > deadline:
                raise DumpMismatch(f"rid {rid}: no {lock.name} in {self.dump_dir}: the server writes without its "
                                   f"lock (use_synchronization_lock off?) or elsewhere; start it with {self.launcher}")
            await asyncio.sleep(0.01)
        fd = os.open(lock, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise DumpMismatch(f"rid {rid}: the server held the lock of {path.name} for {timeout:.0f} s "
                                           "(extract.request_timeout) without finishing the file") from None
                    await asyncio.sleep(0.01)
            if not path.exists():
                raise DumpMismatch(f"rid {rid}: the server released {lock.name} but wrote no {path.name} (its log "
                                   "says why)")
            try:
                return load_file(str(path))
            except SafetensorError as e:
                raise DumpMismatch(f"unreadable dump {path.name}: {e}") from None
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)

    def _split(self, tensors: dict[str, torch.Tensor], rid: str, input_ids: list[int]):
        """(the file's token ids, aux [T,3H], final [T,H]); the shard writer holds the ids against the sample's
        (check_sample: same tokens, one row each), as for every engine."""
        hs, ids = tensors.get("hidden_states"), tensors.get("token_ids")
        if hs is None or ids is None:
            raise DumpMismatch(f"rid {rid}: the file holds {sorted(tensors)}, not hidden_states and token_ids")
        want = (len(input_ids), len(self.layer_ids), self.hidden_size)
        if tuple(hs.shape) != want:
            raise DumpMismatch(f"rid {rid}: the file holds hidden_states {tuple(hs.shape)}, want {want}")
        aux = hs[:, :-1].reshape(len(input_ids), -1)
        return ids, aux, final_norm(hs[:, -1], self.norm_weight, self.norm_eps)

    def probe_hint(self) -> str:
        return (f"The vLLM server does not write hidden states into {self.dump_dir}: start it with {self.launcher} "
                "(--speculative-config extract_hidden_states, --kv-transfer-config ExampleHiddenStatesConnector "
                "with this dir as shared_storage_path)")
