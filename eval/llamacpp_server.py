"""A real llama-server (llama.cpp) on loopback: built once from the cached tree, started as base or
EAGLE-3 speculative server, queried with our exact prompt token ids, and read for its own
speculative-decoding counters (/metrics).

Prompts go to `/completion` as token ids, so both engines see the same sequence whatever either
tokenizer would make of the text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from core.drafters.dflash import is_dflash_dir
from core.run.cli import env_threads
from eval.llamacpp import convert_drafter, convert_to_gguf, gguf_target_layers
from eval.llamacpp_build import llamacpp_tree, server_binary
from eval.spec_counters import PROMETHEUS_PREFIX, prometheus_spec_counters

log = logging.getLogger("eval")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_threads(threads: int | None = None) -> int:
    """llama-server's compute threads (-t): `threads`, else $OMP_NUM_THREADS (the per-process thread count
    core.run.cli.set_threads gives torch; `make test` sets 1), else 2. ggml's threads spin at their barriers, so
    a second one on a core that another process holds loses whole time slices per op (measured: the data_gen
    llama.cpp test 46 s with -t 2, 22 s with -t 1, one of the 2 cores busy elsewhere)."""
    return threads or env_threads() or 2


class SpecDraft(NamedTuple):
    """The drafter a speculative llama-server serves: its GGUF, K drafts per verification, and p_min: 0 = always
    K (τ comparable with our engine's chain); > 0: llama.cpp stops drafting at a draft whose probability is
    below it (no draft at all: a plain decode step), its own way of spending less on unsure drafts."""
    gguf: Path
    k: int = 5
    p_min: float = 0.0
    spec_type: str = "draft-eagle3"  # or draft-dflash (a DFlash block drafter: one pass drafts all k)


class LlamaServer:
    """`with LlamaServer(binary, target_gguf, SpecDraft(drafter_gguf, k=5)) as url:` a llama-server on a free
    loopback port, ready (/health 200) on entry, stopped on exit. draft None: the base server.
    `parallel` slots of `ctx` tokens each; chat requests use the GGUF's own template (--jinja);
    `threads` compute threads (server_threads: None = $OMP_NUM_THREADS, else 2)."""

    def __init__(self, binary: Path, target_gguf: Path, draft: SpecDraft | None = None, threads: int | None = None,
                 parallel: int = 1, ctx: int = 4096, timeout: float = 120.0, extra_args: tuple[str, ...] = ()):
        self.port, self.timeout = _free_port(), timeout
        threads = server_threads(threads)
        self.cmd = [str(binary), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(self.port), "--jinja",
                    "--metrics", "-np", str(parallel), "-c", str(ctx * parallel), "-t", str(threads)]
        if draft is not None:
            # draft tokens sampled on the host, not in the drafter's graph: with several slots drafting at once,
            # b11434's in-graph sampling cut depth-1 acceptance from 0.45 to 0.17 (4 in flight, MT-Bench, the
            # seventh drafter); on the host it stays 0.45, and at 1 in flight τ and speed are the same either way
            self.cmd += ["-md", str(draft.gguf), "--spec-type", draft.spec_type, "--spec-draft-n-max", str(draft.k),
                         "--spec-draft-p-min", str(draft.p_min), "--no-spec-draft-backend-sampling"]
        self.cmd += list(extra_args)  # any other llama-server flags, e.g. ("-fa", "on")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(self.cmd[0]).parent)}  # its libllama/libggml .so files
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"llama-server not ready after {self.timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self.log.seek(0)
        return " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-8:])

    def __exit__(self, *_):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def complete(url: str, prompt_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
    """Greedy completion of exact token ids -> {"tokens", "timings", "stop_type", ...}."""
    body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
            "return_tokens": True, "cache_prompt": False}
    r = httpx.post(f"{url}/completion", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def spec_counters(url: str) -> dict:
    """/metrics -> running totals {"drafts", "draft_tokens", "accepted", "accepted_per_pos"}."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    return prometheus_spec_counters(r.text, PROMETHEUS_PREFIX["llamacpp"])


def target_gguf_choice(target_gguf: str, target_name: str, target_outtype: str, outtype: str) -> tuple[Path | None, str]:
    """The target GGUF llama.cpp serves -> (a file to use, "") or (None, the type to convert our target at):
    eval.target_gguf as given; else SmolLM2's embedded Q4_1 file (ours is dequantized from it) unless
    eval.target_outtype asks for a conversion; else a conversion at target_outtype or the drafter's outtype."""
    from core.target.model import SMOLLM2, embedded_gguf_path

    if target_gguf:
        return Path(target_gguf), ""
    if target_name == SMOLLM2 and not target_outtype:
        return embedded_gguf_path(), ""
    return None, target_outtype or outtype


@contextlib.contextmanager
def served_by_llamacpp(cfg, draft_dir: Path, work_dir: Path, parallel: int):
    """Convert the drafter (and the target, where `target_gguf_choice` says so) with llama.cpp's converter into
    work_dir, start a base and a speculative llama-server with `parallel` slots, yield their URLs. From the run
    config: the model cache, the target, eval.draft_steps (K), eval.draft_p_min, eval.gguf_outtype,
    eval.target_gguf and eval.target_outtype."""
    from core.target.model import cache_root, resolve_target

    ev, cache, target_dir = cfg.eval, cache_root(cfg), resolve_target(cfg)
    binary = server_binary(cache)
    tree = llamacpp_tree(cache)
    work_dir = Path(work_dir)
    draft_gguf = convert_drafter(tree, draft_dir, target_dir, work_dir / f"drafter-{ev.gguf_outtype}.gguf",
                                 ev.gguf_outtype)
    target, convert_at = target_gguf_choice(ev.target_gguf, cfg.target.model, ev.target_outtype, ev.gguf_outtype)
    if target is None:
        target = convert_to_gguf(tree, target_dir, work_dir / f"target-{convert_at}.gguf", convert_at)
    draft = SpecDraft(draft_gguf, ev.draft_steps, ev.draft_p_min)
    if is_dflash_dir(draft_dir):  # one block of K masks per verification, K capped at block_size - 1 as ours is
        block = json.loads((Path(draft_dir) / "config.json").read_text())["dflash_config"]["block_size"]
        draft = draft._replace(k=min(ev.draft_steps, block - 1), spec_type="draft-dflash")
    log.info("llama.cpp: target %s, drafter %s (%s, aux layers %s), K=%d, p_min %g, %d slots", target, draft_gguf,
             draft.spec_type, gguf_target_layers(draft_gguf), draft.k, ev.draft_p_min, parallel)
    with (LlamaServer(binary, target, parallel=parallel) as base,
          LlamaServer(binary, target, draft, parallel=parallel) as spec):
        yield base, spec


@contextlib.contextmanager
def embedded_target_server(gguf: Path | None = None, n_ctx: int = 4096, threads: int | None = None, parallel: int = 4):
    """A llama-server of the embedded SmolLM2 GGUF (or `gguf`) on a free loopback port with `parallel` slots and
    `threads` compute threads (None: $OMP_NUM_THREADS, else 2; server_threads); yields its /v1 base URL: what
    data_gen's openai backend is pointed at (scripts/llamacpp_server.py)."""
    from core.run.config import load_config
    from core.target.model import cache_root, embedded_gguf_path

    binary = server_binary(cache_root(load_config(None)))
    with LlamaServer(binary, gguf or embedded_gguf_path(), threads=threads, parallel=parallel, ctx=n_ctx) as url:
        yield f"{url}/v1"
