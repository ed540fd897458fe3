"""Stock vLLM 0.33 as an extraction server, with no patch: its `extract_hidden_states` speculative method and the
`ExampleHiddenStatesConnector` write each request's hidden states at the layers it is given into one safetensors
file, `hidden_states` [T, n_ids, H] (ids ascending) and `token_ids` [T], and return its path in the response.
What the launcher (extract/vllm_launch.py), the client (extract/vllm_client.py) and `make plan` share.

Layer ids: a vLLM id k is the input of decoder layer k, in every model file (llama.py adds the state after layer
k-1, deepseek_v2.py, which Kimi-K2.5 runs, before layer k): our own convention, so the aux layers go as they are.
The last id, L = the number of layers, is the last layer's output before the final norm; the client applies the
target's final norm to it, which gives what the shards keep as `final`.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_types whose vLLM 0.33 model returns aux states across pipeline stages (`supports_aux_hidden_states_over_pp`
# in llama.py and qwen2.py, which qwen3.py extends); deepseek_v2.py (DeepSeek, Kimi) lacks it and refuses -pp > 1
AUX_OVER_PP = {"llama", "mistral", "qwen2", "qwen3"}
LAUNCH_FILE = "eagle3-launch.json"  # written into the storage dir by the launcher: the ids the server captures


def vllm_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """The ids to give vLLM: the aux layers as they are, then the last layer's output (for `final`)."""
    return [*aux_layers, num_layers]


def server_configs(layer_ids: list[int], storage_dir: Path) -> dict[str, dict]:
    """--speculative-config and --kv-transfer-config of an extraction server writing into storage_dir (with the
    writer's lock on, which the client waits on before it reads a file)."""
    return {
        "--speculative-config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                 "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        "--kv-transfer-config": {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                 "kv_connector_extra_config": {"shared_storage_path": str(storage_dir),
                                                               "use_synchronization_lock": True}},
    }


def server_command(model_path: str, port: int, layer_ids: list[int], storage_dir: Path, trust_remote_code: bool,
                   longest: int, extra: list[str] = ()) -> list[str]:
    """`vllm serve ...` for extraction (argv). --max-model-len: the longest sample and the one token each request
    generates, unless `extra` sets it: the hidden-state cache sits beside the KV cache on every rank
    (`hidden_cache_bytes`), and at the model's own maximum (Kimi-K2.5: 262,144 tokens) a sequence's worth would
    take memory no request of ours uses."""
    cmd = ["vllm", "serve", model_path, "--port", str(port)] + (["--trust-remote-code"] if trust_remote_code else [])
    for flag, value in server_configs(layer_ids, storage_dir).items():
        cmd += [flag, json.dumps(value)]
    if "--max-model-len" not in flag_values(list(extra)):
        cmd += ["--max-model-len", str(longest + 1)]
    return cmd + list(extra)


def hidden_cache_bytes(layer_ids: list[int], hidden: int) -> int:
    """Bytes a token of the hidden-state cache takes on every rank: one cache-only layer of len(ids) x hidden values,
    in bf16 whatever the KV cache dtype (vLLM 0.33's extract_hidden_states model forces its dtype to auto)."""
    return len(layer_ids) * hidden * 2


def flag_values(flags: list[str]) -> dict[str, str]:
    """{--flag: value} of a vLLM command line ("--f v", "--f=v", "-pp v"; a bare switch gets ""); vLLM's parser
    reads `--a_b` as `--a-b`, and so does this."""
    aliases = {"-pp": "--pipeline-parallel-size", "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}
    found = {}
    for i, arg in enumerate(flags):
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            name = aliases.get(name, name.replace("_", "-") if name.startswith("--") else name)
            nxt = flags[i + 1] if i + 1 < len(flags) else ""
            found[name] = value if eq else ("" if nxt.startswith("-") else nxt)
    return found


def refused_flags(flags: list[str], model_type: str) -> list[str]:
    """Why these extra vLLM flags would break capture ([] = none)."""
    got, why = flag_values(flags), []
    for own in ("--speculative-config", "--kv-transfer-config"):
        if own in got:
            why.append(f"{own}: the launcher sets it from the config (aux layers, storage dir, the writer's lock)")
    pp = got.get("--pipeline-parallel-size") or "1"
    if model_type not in AUX_OVER_PP and (not pp.isdigit() or int(pp) > 1):
        why.append(f"--pipeline-parallel-size {pp}: vLLM 0.33's {model_type} model returns no aux states across "
                   "pipeline stages (it refuses extract_hidden_states with pipeline parallelism); use -tp / -dp")
    return why
