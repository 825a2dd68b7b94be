#!/usr/bin/env bash
# Reproduce docs/benchmarks.md: pagedserve against the `--engine hf` baseline (and optionally vLLM),
# all four workloads at concurrency 1, 16 and 64, in one alternating run of `pagedserve bench`.
#
#   scripts/bench_compare.sh [OUT_DIR]
#
# Environment:
#   DURATION=60        measured seconds per (target, workload, concurrency); in-flight requests are cut off
#   WORKLOADS=short,medium,long,mixed   CONCURRENCY=1,16,64
#   DTYPE=bfloat16     pagedserve's dtype (the hf baseline always runs float32, Transformers' default)
#   KV_CACHE=4GiB      pagedserve's KV cache
#   VLLM_URL=http://127.0.0.1:8002   add a running vLLM server as a third target (started by you)
#   VLLM_PID=1234      its server process, for peak RSS of it and its children (else read from its /metrics)
#   VLLM_PYTHON=/tmp/vllm-venv/bin/python   with VLLM_URL: afterwards, the short/medium/long rows with vLLM's own
#                      client (`vllm bench serve`, scripts/vllm_bench_table.py) on pagedserve and vLLM -> OUT/vllm-client
#   VLLM_ROWS="--row 50:100:16:160 ..."      other rows for that table (default: vllm_bench_table.py's seven)
#   EXTRA="..."        more `pagedserve bench` flags, e.g. "--price-per-hour 0.10"
#   BASELINE=0         leave the `--engine hf` baseline out (e.g. the steady-state runs of long and mixed
#                      at concurrency 16 and 64 against vLLM: DURATION=240 WORKLOADS=long,mixed CONCURRENCY=64,16
#                      EXTRA="--warmup-duration 120 --ramp-up 100")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
PY=${PY:-.venv/bin/python}
DURATION=${DURATION:-60}
WORKLOADS=${WORKLOADS:-short,medium,long,mixed}
CONCURRENCY=${CONCURRENCY:-1,16,64}
DTYPE=${DTYPE:-bfloat16}
KV_CACHE=${KV_CACHE:-4GiB}
PAGED_PORT=${PAGED_PORT:-8000}
HF_PORT=${HF_PORT:-8001}

START_TIMEOUT=600
source scripts/servers.sh

mkdir -p "$OUT"
"$PY" scripts/roofline.py --json "$OUT/roofline.json" | tee "$OUT/roofline.txt"
start paged "$PAGED_PORT" --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE" --max-model-len 4096
targets=(--target "pagedserve=http://127.0.0.1:$PAGED_PORT,pid=$paged_pid")
if [[ "${BASELINE:-1}" != 0 ]]; then
  start hf "$HF_PORT" --engine hf --max-model-len 4096
  targets+=(--target "hf=http://127.0.0.1:$HF_PORT,pid=$hf_pid")
fi
if [[ -n "${VLLM_URL:-}" ]]; then targets+=(--target "vllm=$VLLM_URL${VLLM_PID:+,pid=$VLLM_PID}"); fi

# shellcheck disable=SC2086
"$PY" -m pagedserve.bench "${targets[@]}" --workload "$WORKLOADS" --concurrency "$CONCURRENCY" \
  --duration "$DURATION" --drain-timeout 0 --ignore-eos --slo ttft:1s,tpot:100ms --output-dir "$OUT" ${EXTRA:-}
echo "report: $OUT/report.md"

if [[ -n "${VLLM_URL:-}" && -n "${VLLM_PYTHON:-}" ]]; then
  "$PY" -c "import sys; from pagedserve.bench.datasets import load_tokenizer; load_tokenizer().save_pretrained(sys.argv[1])" \
    "$OUT/tokenizer" > /dev/null
  # shellcheck disable=SC2086
  "$PY" scripts/vllm_bench_table.py --vllm-python "$VLLM_PYTHON" --tokenizer "$OUT/tokenizer" \
    --target "pagedserve=http://127.0.0.1:$PAGED_PORT" --target "vllm=$VLLM_URL" --output-dir "$OUT/vllm-client" ${VLLM_ROWS:-}
  echo "vLLM's client: $OUT/vllm-client/table.md"
fi
