#!/usr/bin/env bash
# Start a server on 127.0.0.1:8011, soak it for $1 seconds (default 1800), write $2/ (default soak-out/).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN="${1:-1800}"
OUT="${2:-soak-out}"
PORT="${SOAK_PORT:-8011}"
mkdir -p "$OUT"
.venv/bin/pagedserve serve --host 127.0.0.1 --port "$PORT" --log-stats-interval 0 --disable-access-log \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 1
done
.venv/bin/python -m pagedserve.bench.soak --url "http://127.0.0.1:$PORT" --server-pid "$SERVER" \
    --duration "$SECONDS_TO_RUN" --concurrency 64 --out "$OUT" | tee "$OUT/soak.txt"
