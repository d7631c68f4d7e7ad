# Sourced by the deploy scripts. A Prefect worker can outlive SIGTERM (it turns it into a
# graceful SIGINT shutdown that may never finish): give our own processes 15 s, then SIGKILL
# them, so CI never hangs in cleanup.
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
