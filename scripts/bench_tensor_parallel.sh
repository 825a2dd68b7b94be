#!/usr/bin/env bash
# The tensor-parallelism benchmark of docs/tensor-parallelism.md: one server with the whole model in one
# process (tp1) and one with it split over TP processes (tp2 by default), loaded side by side by
# alternating `pagedserve bench` runs: random prompts at concurrency 1 (TPOT) and 16 (output tok/s),
# --ignore-eos so that both produce the same number of tokens. Memory is each server's process tree
# (workers included).
#
#   scripts/bench_tensor_parallel.sh [OUT_DIR]
#
# Environment: TP=2, DURATION=60 (measured seconds per point), CONCURRENCY=1,16, DTYPE=auto,
# KV_CACHE=1GiB, EXTRA="more bench flags".
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/tensor-parallel}
PY=${PY:-.venv/bin/python}
TP=${TP:-2}
DTYPE=${DTYPE:-auto}
KV_CACHE=${KV_CACHE:-1GiB}
source scripts/servers.sh

mkdir -p "$OUT"
start tp1 8100 --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE" --max-model-len 4096
start "tp$TP" 8101 --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE" --max-model-len 4096 --tensor-parallel-size "$TP"
grep -h "threads:" "$OUT/server-tp1.log" "$OUT/server-tp$TP.log" || true
tp_pid_var="tp${TP}_pid"
# shellcheck disable=SC2086
"$PY" -m pagedserve.bench --target "tp1=http://127.0.0.1:8100,pid=$tp1_pid" \
  --target "tp$TP=http://127.0.0.1:8101,pid=${!tp_pid_var}" \
  --workload random --input-len 256 --output-len 128 --concurrency "${CONCURRENCY:-1,16}" \
  --duration "${DURATION:-60}" --drain-timeout 0 --ignore-eos --num-warmups 2 --seed 1 \
  --output-dir "$OUT" ${EXTRA:-}
echo "report: $OUT/report.md"
