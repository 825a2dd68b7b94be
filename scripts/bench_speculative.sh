#!/usr/bin/env bash
# The speculative-decoding benchmark of docs/speculative-decoding.md: one server without speculation
# and one with SPEC's drafts (vLLM's --speculative-config: n-gram by default, or a draft model), loaded
# side by side by alternating
# `pagedserve bench` runs:
#   1. the input-grounded workload (copy / correct / quote a passage) at concurrency 1: TPOT, greedy,
#      answers end where the model ends them;
#   2. random prompts at concurrency 16 and 64 with --ignore-eos: output tok/s (drafts must not cost
#      throughput where they rarely match).
# Afterwards each server's spec_decode_* counters are printed (acceptance per draft position).
#
#   scripts/bench_speculative.sh [OUT_DIR]
#
# Environment: DURATION=60 (measured seconds per grounded point), RANDOM_DURATION=150 (per random point:
# long enough for requests to complete at concurrency 64 on 2 cores), PHASES="grounded random", DTYPE=auto,
# SPEC='{"method": "ngram", "num_speculative_tokens": 4}', GROUNDED_LEN=200 (passage tokens), KV_CACHE=2GiB,
# EXTRA="more bench flags".
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/speculative}
PY=${PY:-.venv/bin/python}
DURATION=${DURATION:-60}
DTYPE=${DTYPE:-auto}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4}'}
KV_CACHE=${KV_CACHE:-2GiB}
source scripts/servers.sh

mkdir -p "$OUT"
start off 8100 --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE" --max-model-len 4096
start spec 8101 --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE" --max-model-len 4096 --speculative-config "$SPEC"
grep -h "speculative decoding" "$OUT/server-spec.log" || true
targets=(--target "off=http://127.0.0.1:8100,pid=$off_pid" --target "spec=http://127.0.0.1:8101,pid=$spec_pid")
PHASES=${PHASES:-grounded random}
if [[ " $PHASES " == *" grounded "* ]]; then
  # shellcheck disable=SC2086
  "$PY" -m pagedserve.bench "${targets[@]}" --workload grounded --input-len "${GROUNDED_LEN:-200}" --concurrency 1 \
    --duration "$DURATION" --drain-timeout 0 --num-warmups 2 --seed 1 --output-dir "$OUT/grounded" ${EXTRA:-}
fi
if [[ " $PHASES " == *" random "* ]]; then
  # shellcheck disable=SC2086
  "$PY" -m pagedserve.bench "${targets[@]}" --workload random --input-len 256 --output-len 128 --concurrency 16,64 \
    --duration "${RANDOM_DURATION:-150}" --drain-timeout 0 --ignore-eos --num-warmups 4 --seed 1 \
    --output-dir "$OUT/random" ${EXTRA:-}
fi
for port in 8100 8101; do
  echo "port $port:"
  curl -sf "http://127.0.0.1:$port/metrics" | grep '^pagedserve:spec_decode' || echo "  (no spec_decode counters)"
done
echo "reports: $OUT/grounded/report.md $OUT/random/report.md"
