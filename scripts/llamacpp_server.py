"""Serve the embedded SmolLM2 GGUF with llama.cpp's OpenAI-compatible server, on loopback.

    python scripts/llamacpp_server.py --port 8080        # then: data_gen.base_url=http://127.0.0.1:8080/v1

Used by the data_gen integration test and scripts/bench_data_gen_server.py. Needs llama-cpp-python
with its server extra (`make llamacpp`: a ~6 min source build on 2 cores, cached as a wheel).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.target import embedded_gguf_path  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llamacpp_server(gguf: Path | None = None, port: int | None = None, n_ctx: int = 4096, threads: int = 2,
                    startup_timeout: float = 120.0, log_path: Path | None = None):
    """Start `python -m llama_cpp.server`, wait until /v1/models answers, yield the /v1 base URL."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError("llama-cpp-python[server] is not installed: run `make llamacpp`")
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf or embedded_gguf_path()), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--verbose", "false"]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {proc.returncode} at startup: {' '.join(cmd)}")
            try:
                urllib.request.urlopen(url + "/models", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError(f"llama.cpp server not answering at {url} after {startup_timeout:.0f} s") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log_path:
            log.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()
    with llamacpp_server(port=args.port, n_ctx=args.n_ctx) as base_url:
        print(f"serving at {base_url} (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
