#!/usr/bin/env bash
# Start SGLang 0.5.23 as an extraction server for `python -m extract extract.engine=sglang`.
#   scripts/launch_sglang_extract.sh configs/<name>.yaml [key=value ...] [-- extra sglang flags, e.g. --tp 8]
# Aux capture is SGLang's own (--enable-return-aux-hidden-states with EAGLE3 and no draft model); our
# plugin (entry point sglang.srt.plugins, active because EAGLE3_DUMP_DIR is set) writes one
# <rid>.safetensors per request. The radix cache is off: a prefix hit would skip rows. Flags that
# break capture are refused (extract/sglang_launch.py); the watchdog outlasts the slowest dump write.
# Multi-node DP attention: each group leader writes its own requests' dumps, so DUMP_DIR must be one
# directory shared by every node and the client (e.g. NFS), not a per-node /dev/shm.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [key=value ...] [-- sglang flags]}; shift
OVERRIDES=(); while [[ $# -gt 0 && $1 != "--" ]]; do OVERRIDES+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
VARS=$(python -m extract.sglang_launch --config "$CONFIG" "${OVERRIDES[@]}" -- "$@")
eval "$VARS"
mkdir -p "$DUMP_DIR"
export EAGLE3_DUMP_DIR="$DUMP_DIR"
# SGLANG_PLUGINS, when set, is a whitelist of plugin names: keep ours in it
if [[ -n ${SGLANG_PLUGINS:-} && ",$SGLANG_PLUGINS," != *,eagle3_hidden_dump,* ]]; then
  export SGLANG_PLUGINS="$SGLANG_PLUGINS,eagle3_hidden_dump"
fi
# shellcheck disable=SC2086  # LAYER_IDS is a space-separated list, REMOTE_CODE one flag or empty, on purpose
exec python -m sglang.launch_server --model-path "$MODEL_PATH" $REMOTE_CODE --port "$PORT" \
  --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \
  --return-aux-hidden-state-layer-ids $LAYER_IDS --disable-radix-cache \
  --watchdog-timeout "$WATCHDOG_TIMEOUT" "$@"
