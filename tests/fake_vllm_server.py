"""TEST DOUBLE of `vllm serve` 0.33 as scripts/launch_vllm_extract.sh starts it (extract_hidden_states + the
ExampleHiddenStatesConnector): GET /health and /v1/models, POST /v1/completions, on loopback.

It is configured by the argv the launcher printed (the layer ids in --speculative-config, the storage dir and
lock switch in --kv-transfer-config), and each request runs through the connector's own code, compiled from
vLLM's source (tests/vllm_source.hidden_states_connector): build_connector_meta names the file from the
engine's request id (`cmpl-<X-Request-Id>-0-<8 random>`), wait_for_save pre-creates its lock under LOCK_EX before
the answer leaves, request_finished returns `hidden_states_path`, and _write_tensors writes `hidden_states` and
`token_ids` in a writer thread and then releases the lock. Only the GPU half of _submit_async_write (the
KV-cache gather, CUDA streams) is replaced: the states come from the target in-process (core/hidden_capture), id
k < L as hidden_states[k] (the input of layer k) and id L as the last layer's output before the final norm,
stacked [T, ids, H] in id order, as vLLM's proposer stacks them (tests/test_extract_vllm.py ties that to vLLM's
own capture loops). Each write first leaves a truncated file for `write_delay` seconds, as save_file does while it
writes, so a reader that ignores the lock reads garbage.

Faults, each for the prompts named (token id lists), on their first request: `no_file` (the write fails: lock
released, no file), `truncated` (a truncated file is all that is written), `other_ids` (the file's token_ids
differ), `other_prompt` (the answer's prompt_token_ids differ), `locked` (the lock is never released), `no_path`
(an answer without kv_transfer_params).
"""

from __future__ import annotations

import json
import os
import shlex
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from core.target.hidden_capture import capture
from tests.loopback_http import LoopbackServer, QuietHandler
from tests.vllm_source import hidden_states_connector, internal_request_id

FAULTS = ("no_file", "truncated", "other_ids", "other_prompt", "locked", "no_path")


class _Event:  # the CUDA event _write_tensors waits on: the copy is done when the states exist
    def synchronize(self):
        pass


class FakeVLLMServer(LoopbackServer):
    def __init__(self, model, launch_command: str, write_delay: float = 0.05, **faults):
        argv = shlex.split(launch_command)
        assert argv[:2] == ["vllm", "serve"], argv
        flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
        spec, kv = json.loads(flags["--speculative-config"]), json.loads(flags["--kv-transfer-config"])
        assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
        self.layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        extra = kv["kv_connector_extra_config"]
        self.storage = Path(extra["shared_storage_path"])
        self.connector, _ = hidden_states_connector(self.storage, extra.get("use_synchronization_lock", True))
        self.model, self.name, self.write_delay = model, argv[2], write_delay
        unknown = set(faults) - set(FAULTS)
        assert not unknown, unknown
        self.faults = {f: {tuple(p) for p in faults.get(f, ())} for f in FAULTS}
        self.scheduler = threading.Lock()  # one engine loop: the connector's state is touched by one step at a time
        self.writer = ThreadPoolExecutor(4, thread_name_prefix="vllm-hs-save")
        self.requests: list[str] = []
        server = self

        class Handler(QuietHandler):
            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                if self.path != "/v1/completions":
                    return self._send(404, {"error": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("model") != server.name:
                    return self._send(404, {"error": f"model {body.get('model')!r} does not exist"})
                return self._send(200, server.complete(body, self.headers.get("X-Request-Id")))

            def _send(self, status, obj):
                self.reply(status, json.dumps(obj).encode())

        self.serve(Handler)
        self.url = f"http://127.0.0.1:{self.port}"

    def _once(self, fault: str, ids: list[int]) -> bool:
        if tuple(ids) not in self.faults[fault]:
            return False
        self.faults[fault].discard(tuple(ids))
        return True

    def complete(self, body: dict, header_id: str | None) -> dict:
        ids = list(body["prompt"])
        assert body.get("max_tokens") == 1 and body.get("return_token_ids") is True, body
        req_id = internal_request_id(header_id or os.urandom(8).hex())
        self.requests.append(req_id)
        faults = {f for f in FAULTS if self._once(f, ids)}
        with self.scheduler:  # one engine step: schedule, lock, prefill, finish
            self.connector._connector_metadata = self.connector.build_connector_meta(types.SimpleNamespace(
                scheduled_new_reqs=[types.SimpleNamespace(req_id=req_id, sampling_params=None)]))
            self.connector.wait_for_save()
            states = self._states(ids)
            request = types.SimpleNamespace(request_id=req_id, kv_transfer_params=None, prompt_token_ids=ids,
                                            all_token_ids=ids + [0])
            _, params = self.connector.request_finished(request, [0])
            pending = self.connector._pending_saves.pop(req_id)
            lock_fd = self.connector._lock_fds.pop(req_id, None)
        token_ids = pending.token_ids.clone() if "other_ids" not in faults else pending.token_ids.flip(0)
        if "locked" not in faults:
            self.writer.submit(self._write, {"hidden_states": states, "token_ids": token_ids}, pending.filename,
                               lock_fd, faults)
        answer = {"id": req_id.rsplit("-", 2)[0], "object": "text_completion", "model": self.name,
                  "choices": [{"index": 0, "text": "", "prompt_token_ids": ids[::-1] if "other_prompt" in faults
                               else ids, "token_ids": [0], "finish_reason": "length"}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}
        return answer if "no_path" in faults else {**answer, "kv_transfer_params": params}

    def _states(self, ids: list[int]) -> torch.Tensor:
        """[T, len(layer_ids), H]: hidden_states[k] for k < L, the last layer's pre-norm output for L."""
        decoder = self.model.get_decoder()
        seen = []
        hook = decoder.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        try:
            x = torch.tensor([ids], device=self.model.device)
            aux, _ = capture(self.model, x, torch.ones_like(x), self.layer_ids[:-1])
        finally:
            hook.remove()
        assert self.layer_ids[-1] == len(decoder.layers), self.layer_ids
        n_aux = len(self.layer_ids) - 1
        return torch.cat([aux[0].view(len(ids), n_aux, -1), seen[0][0][:, None]], dim=1).cpu()

    def _write(self, tensors: dict, filename: str, lock_fd: int | None, faults: set[str]) -> None:
        """The worker's writer thread: a truncated file while save_file writes, then the connector's own
        _write_tensors (which releases the lock)."""
        from safetensors.torch import save_file

        save_file(tensors, filename)
        whole = Path(filename).read_bytes()
        Path(filename).write_bytes(whole[: len(whole) // 2])
        time.sleep(self.write_delay)
        if "truncated" in faults:
            os.close(lock_fd)
            return
        if "no_file" in faults:
            os.unlink(filename)
            os.close(lock_fd)
            return
        self.connector._write_tensors(tensors, _Event(), filename, lock_fd)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.writer.shutdown(wait=True)
