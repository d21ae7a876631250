#!/usr/bin/env bash
# The serving benchmark of BENCHMARKS.md: starts the bench cluster (embedded
# NATS, gateway + router, two mocker workers at no simulated delay), runs
# `dynamoctl bench` non-streaming and streaming (64 concurrent, 2,000 chat
# requests, ~60-token prompts, 16 output tokens), and reports CPU-ms per
# request for the server processes (dynamo-node + its nats-server) from /proc.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/release}
CONFIG=${CONFIG:-cluster-config/examples/bench.toml}
URL=${URL:-http://127.0.0.1:8000}
REQUESTS=${REQUESTS:-2000}
CONCURRENCY=${CONCURRENCY:-64}
LOG=$(mktemp /tmp/dynamo-bench-node.XXXXXX.log)
. scripts/lib_node.sh
start_node "$CONFIG" "$URL" 2 "$LOG"
NATS=$(pgrep -P $NODE nats-server || true)
TCK=$(getconf CLK_TCK)
ticks() { # utime + stime of the given pids
  local t=0
  for p in "$@"; do
    [ -n "$p" ] || continue
    t=$((t + $(awk '{print $14 + $15}' /proc/$p/stat)))
  done
  echo $t
}

# Warm up (tokenizer load, connections).
"$BIN/dynamoctl" bench --url "$URL" --concurrency 8 --requests 200 --max-tokens 16 --prompt-tokens 60 --json >/dev/null

machine
for mode in "" "--stream"; do
  c0=$(ticks $NODE $NATS)
  out=$("$BIN/dynamoctl" bench --url "$URL" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
        --max-tokens 16 --prompt-tokens 60 $mode --json)
  c1=$(ticks $NODE $NATS)
  node_ms=$(awk -v a="$c0" -v b="$c1" -v t="$TCK" -v n="$REQUESTS" 'BEGIN {printf "%.3f", (b - a) * 1000 / t / n}')
  echo "${mode:-non-stream} $out"
  echo "${mode:-non-stream} server_cpu_ms_per_request=$node_ms node_rss_mb=$(rss_mb $NODE) node_peak_rss_mb=$(hwm_mb $NODE)${NATS:+ nats_rss_mb=$(rss_mb $NATS)}"
done
