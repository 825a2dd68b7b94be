#!/usr/bin/env bash
# Reproduce docs/scale-out.md's tables with `pagedserve bench`, each from one side-by-side run:
#
#   scripts/bench_scale_out.sh overhead [OUT_DIR]   plain `pagedserve serve` against `--replicas 1` on Ray
#                                                   (short and long, concurrency 16)
#   scripts/bench_scale_out.sh routing [OUT_DIR]    2 replicas each behind round-robin, least-loaded and
#                                                   prefix-affinity, on the shared-prefix workload
#
# Environment: DURATION=60 (measured seconds per point), DTYPE=bfloat16, EXTRA="more bench flags";
# routing: FAMILIES=16 prompt families of PREFIX=1024 tokens (+ SUFFIX=64 unique, OUTPUT=64 generated),
# KV_CACHE=448MiB per replica (a little under half the families' prefixes fit in one replica next to
# the running requests), CONCURRENCY=16. (Not GROUPS: bash presets that name to the user's group ids.)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?overhead or routing}
OUT=${2:-bench-out/scale-out-$MODE}
PY=${PY:-.venv/bin/python}
DURATION=${DURATION:-60}
DTYPE=${DTYPE:-bfloat16}

source scripts/servers.sh

mkdir -p "$OUT"
case "$MODE" in
  overhead)
    start plain 8000 --dtype "$DTYPE" --kv-cache-memory 2GiB --max-model-len 4096
    start ray-1 8001 --dtype "$DTYPE" --kv-cache-memory 2GiB --max-model-len 4096 --replicas 1 --cpus-per-replica "$(nproc)"
    # shellcheck disable=SC2086
    "$PY" -m pagedserve.bench --target "plain=http://127.0.0.1:8000,pid=$plain_pid" \
      --target "ray-replicas-1=http://127.0.0.1:8001,pid=$ray_1_pid" --workload short,long --concurrency 16 \
      --duration "$DURATION" --drain-timeout 0 --ignore-eos --output-dir "$OUT" ${EXTRA:-}
    ;;
  routing)
    port=8010
    targets=()
    for router in round-robin least-loaded prefix-affinity; do
      start "$router" "$port" --dtype "$DTYPE" --kv-cache-memory "${KV_CACHE:-448MiB}" --max-model-len 2048 --replicas 2 \
        --cpus-per-replica 1 --request-router "$router"
      pid_var="${router//-/_}_pid"
      targets+=(--target "$router=http://127.0.0.1:$port,pid=${!pid_var}")
      port=$((port + 1))
    done
    urls=(round-robin=http://127.0.0.1:8010 least-loaded=http://127.0.0.1:8011 prefix-affinity=http://127.0.0.1:8012)
    "$PY" scripts/prefix_cache_rates.py snapshot "$OUT/counters-before.json" "${urls[@]}"
    # shellcheck disable=SC2086
    "$PY" -m pagedserve.bench "${targets[@]}" --workload shared-prefix --num-prefix-groups "${FAMILIES:-16}" \
      --shared-prefix-len "${PREFIX:-1024}" --input-len "${SUFFIX:-64}" --output-len "${OUTPUT:-64}" \
      --concurrency "${CONCURRENCY:-16}" --duration "$DURATION" --drain-timeout 0 --ignore-eos \
      --output-dir "$OUT" ${EXTRA:-}
    "$PY" scripts/prefix_cache_rates.py snapshot "$OUT/counters-after.json" "${urls[@]}"
    "$PY" scripts/prefix_cache_rates.py diff "$OUT/counters-before.json" "$OUT/counters-after.json" \
      | tee "$OUT/prefix-cache.md"
    ;;
  *) echo "mode: overhead or routing" >&2; exit 2 ;;
esac
echo "report: $OUT/report.md"
