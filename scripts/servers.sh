# Sourced by the benchmark scripts: start `pagedserve serve` processes in the background, wait until
# each answers /health, and stop them all when the script exits.
#
#   source scripts/servers.sh     (needs PY and OUT set; START_TIMEOUT=900 seconds per server)
#   start NAME PORT ARGS...       -> the server's log in $OUT/server-NAME.log, its pid in ${NAME}_pid
#                                    (dashes in NAME become underscores)

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start() {
  local name=$1 port=$2; shift 2
  "$PY" -m pagedserve.cli serve --port "$port" "$@" > "$OUT/server-$name.log" 2>&1 &
  pids+=($!)
  eval "${name//-/_}_pid=$!"
  for _ in $(seq 1 "${START_TIMEOUT:-900}"); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then return 0; fi
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then break; fi
    sleep 1
  done
  echo "$name did not come up; see $OUT/server-$name.log" >&2
  exit 1
}
