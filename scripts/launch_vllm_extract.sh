#!/usr/bin/env bash
# Start stock vLLM 0.33 as an extraction server for `python -m extract extract.engine=vllm` (no patch, no plugin).
#   scripts/launch_vllm_extract.sh configs/<name>.yaml [key=value ...] [-- extra vllm flags, e.g. -tp 8]
# vLLM's extract_hidden_states method and its ExampleHiddenStatesConnector write one safetensors file per request
# (the aux layers and the last layer's output) into extract.dump_dir (default <run>/dumps), under a writer's lock
# the client waits on. The command comes from the run config (extract/vllm_launch.py), which refuses flags that
# break capture and records the layer ids in the storage dir for the client to check. The storage dir must be
# the client's too (one host, or a shared filesystem).
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [key=value ...] [-- vllm flags]}; shift
OVERRIDES=(); while [[ $# -gt 0 && $1 != "--" ]]; do OVERRIDES+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
CMD=$(python -m extract.vllm_launch --config "$CONFIG" "${OVERRIDES[@]}" -- "$@")
eval "exec $CMD"
