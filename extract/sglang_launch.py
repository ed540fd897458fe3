"""Shell assignments for scripts/launch_sglang_extract.sh, from the run config (one source of truth).

    python -m extract.sglang_launch --config configs/<name>.yaml [key=value ...] [-- sglang flags]

Prints MODEL_PATH, REMOTE_CODE ("--trust-remote-code" when target.trust_remote_code is set, else empty), LAYER_IDS (the ids SGLang needs to capture the config's aux layers: Llama/Qwen
files add +1, DeepSeek/Kimi only when the first id is 1; core/target/aux_layers.py), PORT, DUMP_DIR and
WATCHDOG_TIMEOUT. Exits 2 naming the flag when the SGLang flags after `--` would break capture.
"""

from __future__ import annotations

import shlex
import sys
from urllib.parse import urlparse

from core.run.cli import parse_stage_args
from core.run.config import RunConfig
from core.target.aux_layers import resolve_aux_layers, sglang_layer_ids
from core.target.model import target_info

# models whose layers after the dense ones run without aux capture under two-batch overlap
# (sglang/srt/models/deepseek_v2.py, forward: model_forward_stages(..., enable_tbo=True))
_TBO_SKIPS_CAPTURE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"}
SGLANG_DEFAULT_WATCHDOG_S = 300


def flag_values(flags: list[str]) -> dict[str, str]:
    """{--flag: value} of an SGLang command line ("--f v", "--f=v"; a bare switch gets "")."""
    found = {}
    for i, arg in enumerate(flags):
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            nxt = flags[i + 1] if i + 1 < len(flags) else ""
            found[name] = value if eq else ("" if nxt.startswith("--") else nxt)
    return found


def refused_flags(flags: list[str], model_type: str) -> list[str]:
    """Why these SGLang flags would make dumps wrong or missing ([] = none)."""
    got, why = flag_values(flags), []
    if "--attn-cp-size" in got and int(got["--attn-cp-size"] or 1) > 1:
        why.append("--attn-cp-size > 1: each CP rank holds part of a prompt's rows; untested for capture")
    if "--enable-two-batch-overlap" in got and model_type in _TBO_SKIPS_CAPTURE:
        why.append(f"--enable-two-batch-overlap: {model_type} layers run under it skip aux capture")
    if got.get("--disaggregation-mode") == "prefill":
        why.append("--disaggregation-mode prefill: the prefill server never calls the plugin's hook")
    if "--allow-auto-truncate" in got:
        why.append("--allow-auto-truncate: a truncated prompt's rows do not cover the sample")
    if "--enable-hierarchical-cache" in got:
        why.append("--enable-hierarchical-cache: a prefix-cache hit computes no rows")
    return why


def launch_vars(cfg: RunConfig) -> tuple[dict[str, str], str]:
    """(shell variables, the target's model_type)."""
    info = target_info(cfg)
    aux = resolve_aux_layers(cfg.extract.aux_layers, info.num_layers)
    model_type = info.model_type  # the language model's (Kimi-K2.5: text_config's kimi_k2)
    # the scheduler blocks on a full dump queue for at most one dump write, which the client waits
    # for at most request_timeout: SGLang's watchdog must not kill the server before that
    watchdog = SGLANG_DEFAULT_WATCHDOG_S + cfg.extract.request_timeout
    return {"MODEL_PATH": str(info.path),
            "REMOTE_CODE": "--trust-remote-code" if cfg.target.trust_remote_code else "",
            "LAYER_IDS": " ".join(str(i) for i in sglang_layer_ids(aux, model_type)),
            "PORT": str(urlparse(cfg.extract.server_url).port or 30000),
            "DUMP_DIR": str(cfg.extract.dump_dir or cfg.run_path / "dumps"),
            "WATCHDOG_TIMEOUT": f"{watchdog:.0f}"}, model_type


if __name__ == "__main__":
    argv = sys.argv[1:]
    own, sglang_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    cfg, _ = parse_stage_args("extract.sglang_launch", __doc__, argv=own)
    env, model_type = launch_vars(cfg)
    if refused := refused_flags(sglang_flags, model_type):
        sys.exit("extract.sglang_launch: error: flags that break hidden-state capture:\n  " + "\n  ".join(refused))
    sys.stdout.write("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))
