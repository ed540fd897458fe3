"""Serve the embedded SmolLM2 GGUF with llama.cpp's llama-server (OpenAI-compatible), on loopback.

    python scripts/llamacpp_server.py                    # then: data_gen.base_url=<the printed URL>

The server is eval.llamacpp_server.embedded_target_server (the data_gen tests and
bench/bench_data_gen_server.py start it too). The binary is the one `make llamacpp`
(python3 -m eval.llamacpp_build) builds into the model cache once.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.llamacpp_server import embedded_target_server  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-ctx", type=int, default=4096, help="context per slot")
    ap.add_argument("--parallel", type=int, default=4, help="slots (requests decoded together)")
    args = ap.parse_args()
    with embedded_target_server(n_ctx=args.n_ctx, parallel=args.parallel) as base_url:
        print(f"serving at {base_url} (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
