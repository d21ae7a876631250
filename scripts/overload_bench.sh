#!/usr/bin/env bash
# The overload benchmark of BENCHMARKS.md: the overload cluster (embedded
# NATS, gateway limit 256 in flight, two real-time mocker workers), then in
# one run a light baseline (LIGHT clients), a baseline below the limit (BASE
# clients) and a ten-fold overload (OVER clients), SECS seconds each. Clients are closed-loop and wait what
# Retry-After says after a refusal (jittered); outputs are 16 to 112 tokens
# (mean 64); clients start over 2 s. Reports latency of admitted requests,
# time to a 429/503, and the node's RSS at start, peak and end.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release
CONFIG=${CONFIG:-cluster-config/examples/overload.toml}
URL=${URL:-http://127.0.0.1:8000}
BASE=${BASE:-200}
OVER=${OVER:-2000}
SECS=${SECS:-20}
LIGHT=${LIGHT:-16}
LOG=$(mktemp /tmp/dynamo-overload-node.XXXXXX.log)
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

. scripts/lib_node.sh
start_node "$CONFIG" "$URL" 2 "$LOG"
bench() { "$BIN/dynamoctl" bench --url "$URL" --max-tokens 64 --vary-output --prompt-tokens 60 --ramp-s 2 --json "$@"; }

machine
"$BIN/dynamoctl" bench --url "$URL" --concurrency 16 --requests 200 --json >/dev/null   # warm-up
echo "node rss at start: $(rss_mb $NODE) MB"
echo "light baseline ($LIGHT clients): $(bench --concurrency "$LIGHT" --duration-s "$SECS")"
echo "baseline ($BASE clients): $(bench --concurrency "$BASE" --duration-s "$SECS")"
echo "overload ($OVER clients): $(bench --concurrency "$OVER" --duration-s "$SECS")"
echo "node rss right after the load: $(rss_mb $NODE) MB, peak $(hwm_mb $NODE) MB"
sleep 10
echo "node rss 10 s after the load: $(rss_mb $NODE) MB"
# The same overload again: memory that grew per request would show here.
echo "overload again ($OVER clients): $(bench --concurrency "$OVER" --duration-s "$SECS")"
sleep 10
echo "node rss 10 s after the second load: $(rss_mb $NODE) MB, peak $(hwm_mb $NODE) MB"
curl -s "$URL/metrics" | grep -E '^dynamo_gateway_rejected_requests_total' || true
