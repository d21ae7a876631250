# Shared by the benchmark scripts (sourced): start one dynamo-node from a
# config and wait until its gateway reports the workers it should have.
#   start_node CONFIG URL WORKERS LOG   sets NODE (its pid) and stops it on exit
start_node() {
  local config=$1 url=$2 workers=$3 log=$4
  if curl -s -o /dev/null "$url/health"; then
    echo "$(basename "$0"): something already listens on $url; stop it first" >&2
    exit 1
  fi
  "$BIN/dynamo-node" --config "$config" >"$log" 2>&1 &
  NODE=$!
  trap 'kill -TERM $NODE 2>/dev/null || true; wait $NODE 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do
    if curl -s "$url/health" | grep -q "\"workers\":$workers"; then return; fi
    if ! kill -0 "$NODE" 2>/dev/null; then echo "$(basename "$0"): node died; see $log" >&2; exit 1; fi
    sleep 0.1
  done
}
rss_mb() { awk '/VmRSS/ {printf "%.1f", $2/1024}' "/proc/$1/status"; }
hwm_mb() { awk '/VmHWM/ {printf "%.1f", $2/1024}' "/proc/$1/status"; }
machine() {
  echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
}
