# Sourced by the deploy scripts (they set PORT, PREFECT_API_URL, LOGS and the pids array).

# A Prefect worker can outlive SIGTERM (it turns it into a graceful SIGINT shutdown that may
# never finish): give our own processes 15 s, then SIGKILL them, so CI never hangs in cleanup.
stop_pids() {
  local pid
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 15); do
    local alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && return 0
    sleep 1
  done
  for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}

# Start a Prefect server on 127.0.0.1:$PORT (refusing a port already in use) and wait for health.
start_prefect_server() {
  if curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1; then
    echo "a server already answers on port $PORT: set LORASHIP_PREFECT_PORT to a free port" >&2
    exit 1
  fi
  prefect server start --host 127.0.0.1 --port "$PORT" >"$LOGS/server.log" 2>&1 &
  local server=$!
  pids+=("$server")
  for _ in $(seq 180); do
    curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { tail -30 "$LOGS/server.log" >&2; exit 1; }
    sleep 1
  done
  curl -fsS "$PREFECT_API_URL/health" >/dev/null || { tail -30 "$LOGS/server.log" >&2; exit 1; }
}
