"""Shell assignments for scripts/launch_sglang_extract.sh, from the run config (one source of truth).

    python -m extract.sglang_launch --config configs/<name>.yaml [key=value ...]

Prints MODEL_PATH, LAYER_IDS (the ids SGLang needs to capture the config's aux layers: Llama/Qwen
files add +1, DeepSeek/Kimi only when the first id is 1; core/aux_layers.py), PORT and DUMP_DIR.
"""

from __future__ import annotations

import shlex
import sys
from urllib.parse import urlparse

from core.aux_layers import resolve_aux_layers, sglang_layer_ids
from core.cli import parse_stage_args
from core.config import RunConfig
from core.target import resolve_target, target_info


def launch_vars(cfg: RunConfig) -> dict[str, str]:
    info = target_info(cfg)
    aux = resolve_aux_layers(cfg.extract.aux_layers, info.num_layers)
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(resolve_target(cfg)).model_type
    return {"MODEL_PATH": str(resolve_target(cfg)),
            "LAYER_IDS": " ".join(str(i) for i in sglang_layer_ids(aux, model_type)),
            "PORT": str(urlparse(cfg.extract.server_url).port or 30000),
            "DUMP_DIR": str(cfg.extract.dump_dir or cfg.run_path / "dumps")}


if __name__ == "__main__":
    cfg, _ = parse_stage_args("extract.sglang_launch", __doc__)
    sys.stdout.write("".join(f"{k}={shlex.quote(v)}\n" for k, v in launch_vars(cfg).items()))
