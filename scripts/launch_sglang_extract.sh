#!/usr/bin/env bash
# Start SGLang 0.5.23 as an extraction server for `python -m extract extract.engine=sglang`.
#   scripts/launch_sglang_extract.sh configs/<name>.yaml [key=value ...] [-- extra sglang flags, e.g. --tp 8]
# Aux capture is SGLang's own (--enable-return-aux-hidden-states with EAGLE3 and no draft model); our
# plugin (entry point sglang.srt.plugins, active because EAGLE3_DUMP_DIR is set) writes one
# <rid>.safetensors per request. The radix cache is off: a prefix hit would skip rows.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [key=value ...] [-- sglang flags]}; shift
OVERRIDES=(); while [[ $# -gt 0 && $1 != "--" ]]; do OVERRIDES+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
eval "$(python -m extract.sglang_launch --config "$CONFIG" "${OVERRIDES[@]}")"
mkdir -p "$DUMP_DIR"
export EAGLE3_DUMP_DIR="$DUMP_DIR"
# shellcheck disable=SC2086  # LAYER_IDS is a space-separated list on purpose
exec python -m sglang.launch_server --model-path "$MODEL_PATH" --port "$PORT" \
  --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \
  --return-aux-hidden-state-layer-ids $LAYER_IDS --disable-radix-cache "$@"
