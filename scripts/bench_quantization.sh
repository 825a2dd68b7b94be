#!/usr/bin/env bash
# The quantization benchmark of docs/benchmarks.md: one server per weight-storage scheme (none = bf16,
# gguf, int4, int8) on the default model, loaded side by side by one alternating `pagedserve bench` run:
# median TPOT at concurrency 1 (short and long) and output tok/s at 16 and 64.
#
#   scripts/bench_quantization.sh [OUT_DIR]
#
# Environment: DURATION=20 (measured seconds per target, workload and concurrency),
# WORKLOADS=short,long  CONCURRENCY=1,16,64  SCHEMES="none gguf int4 int8"  KV_CACHE=2GiB;
# LLAMA_SERVER=/tmp/llama.cpp/build/bin/llama-server (from scripts/build_llama_cpp.sh) adds llama.cpp's own
# server on the same GGUF file as a target (all threads, one slot per client up to LLAMA_PARALLEL=1).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-quant}
PY=${PY:-.venv/bin/python}
DURATION=${DURATION:-20}
WORKLOADS=${WORKLOADS:-short,long}
CONCURRENCY=${CONCURRENCY:-1,16,64}
SCHEMES=${SCHEMES:-none gguf int4 int8}
KV_CACHE=${KV_CACHE:-2GiB}

START_TIMEOUT=600
source scripts/servers.sh

mkdir -p "$OUT"
targets=()
port=8100
for scheme in $SCHEMES; do
  start "$scheme" "$port" --quantization "$scheme" --kv-cache-memory "$KV_CACHE" --max-model-len 4096
  targets+=(--target "$scheme=http://127.0.0.1:$port,pid=${pids[-1]}")
  grep -h "model weights" "$OUT/server-$scheme.log" | sed "s/^/$scheme: /" || true
  port=$((port + 1))
done
if [[ -n "${LLAMA_SERVER:-}" ]]; then
  gguf=$("$PY" -c "from pagedserve.models.default_model import default_model_path; print(default_model_path())")
  "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$(nproc)" -c 8192 --parallel "${LLAMA_PARALLEL:-1}" \
    > "$OUT/server-llama.cpp.log" 2>&1 &
  pids+=($!)
  targets+=(--target "llama.cpp=http://127.0.0.1:$port,pid=$!")
  for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then break; fi
    sleep 1
  done
fi
"$PY" -m pagedserve.bench "${targets[@]}" --workload "$WORKLOADS" --concurrency "$CONCURRENCY" \
  --duration "$DURATION" --drain-timeout 0 --ignore-eos --num-warmups 4 --seed 1 --output-dir "$OUT" ${EXTRA:-}
echo "report: $OUT/report.md"
