"""Serve the embedded SmolLM2 GGUF with llama.cpp's llama-server (OpenAI-compatible), on loopback.

    python scripts/llamacpp_server.py                    # then: data_gen.base_url=<the printed URL>
    python scripts/llamacpp_server.py --build-only       # `make llamacpp`: fetch + build once, print the binary

Used by the data_gen integration test and scripts/bench_data_gen_server.py. The binary is the one
`make llamacpp` builds into the model cache (eval/llamacpp_server.py: 368 s once on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli import setup_logging  # noqa: E402
from core.config import load_config  # noqa: E402
from core.target import cache_root, embedded_gguf_path  # noqa: E402
from eval.llamacpp_server import LlamaServer, server_binary  # noqa: E402


@contextlib.contextmanager
def llamacpp_server(gguf: Path | None = None, n_ctx: int = 4096, threads: int | None = None, parallel: int = 4):
    """A llama-server on a free loopback port with `parallel` slots and `threads` compute threads
    (None: $OMP_NUM_THREADS, else 2; eval.llamacpp_server.server_threads); yields its /v1 base URL."""
    binary = server_binary(cache_root(load_config(None)))
    with LlamaServer(binary, gguf or embedded_gguf_path(), threads=threads, parallel=parallel, ctx=n_ctx) as url:
        yield f"{url}/v1"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-ctx", type=int, default=4096, help="context per slot")
    ap.add_argument("--parallel", type=int, default=4, help="slots (requests decoded together)")
    ap.add_argument("--build-only", action="store_true", help="build (once) and print the binary's path")
    args = ap.parse_args()
    if args.build_only:
        setup_logging()
        print(server_binary(cache_root(load_config(None))))
        sys.exit(0)
    with llamacpp_server(n_ctx=args.n_ctx, parallel=args.parallel) as base_url:
        print(f"serving at {base_url} (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
