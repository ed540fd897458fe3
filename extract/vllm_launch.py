"""The `vllm serve` command of an extraction server, from the run config (one source of truth), for
scripts/launch_vllm_extract.sh:

    python -m extract.vllm_launch --config configs/<name>.yaml [key=value ...] [-- vllm flags]

Prints the command, shell-quoted (core/target/vllm_extract.py: the layer ids in vLLM's convention, the speculative and
KV-transfer configs, --trust-remote-code when target.trust_remote_code is set), and records the layer ids in the
storage dir (eagle3-launch.json), where the client checks them against its own config before it sends anything.
Exits 2 naming the flag when the vLLM flags after `--` would break capture.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from urllib.parse import urlparse

from core.run.cli import parse_stage_args
from core.run.config import RunConfig
from core.run.plan import tokens_cap
from core.storage.atomic_io import atomic_write_json
from core.target.aux_layers import resolve_aux_layers
from core.target.model import target_info
from core.target.vllm_extract import LAUNCH_FILE, refused_flags, server_command, vllm_layer_ids


def storage_dir(cfg: RunConfig) -> Path:
    """Where the server writes and the client reads: extract.dump_dir, else <run>/dumps (absolute: the server
    runs elsewhere)."""
    return Path(cfg.extract.dump_dir or cfg.run_path / "dumps").resolve()


def launch(cfg: RunConfig, extra: list[str]) -> tuple[list[str], list[int], str]:
    """(the server's argv, its layer ids, the target's model_type)."""
    info = target_info(cfg)
    ids = vllm_layer_ids(resolve_aux_layers(cfg.extract.aux_layers, info.num_layers), info.num_layers)
    port = urlparse(cfg.extract.server_url).port or 8000
    return (server_command(str(info.path), port, ids, storage_dir(cfg), cfg.target.trust_remote_code,
                           tokens_cap(cfg), extra), ids, info.model_type)


if __name__ == "__main__":
    argv = sys.argv[1:]
    own, vllm_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    cfg, _ = parse_stage_args("extract.vllm_launch", __doc__, argv=own)
    cmd, ids, model_type = launch(cfg, vllm_flags)
    if refused := refused_flags(vllm_flags, model_type):
        sys.exit("extract.vllm_launch: error: flags that break hidden-state capture: " + "; ".join(refused))
    atomic_write_json(storage_dir(cfg) / LAUNCH_FILE, {"layer_ids": ids, "target": cfg.target.model})
    sys.stdout.write(shlex.join(cmd) + "\n")
