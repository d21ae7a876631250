#!/usr/bin/env bash
# KV-routing benchmark of BENCHMARKS.md: replays the Mooncake conversation
# trace (time-compressed) against one node with 8 mocker workers whose KV
# pools are small enough to force eviction, once per routing policy (RUNS
# times each, interleaved), and prints dynamoctl replay's JSON for each; the
# JSON carries the oracle (`oracle_cached_tokens`) and `cached_vs_oracle`.
#
# Issue #19's setup: TOKEN_SCALE=8 SPEEDUP=8 MOCKER_SPEEDUP=1 BLOCKS=20932 RUNS=3.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release
TRACE=${TRACE:-../shared/traces/mooncake/conversation_trace.jsonl}
REQUESTS=${REQUESTS:-1000}
SPEEDUP=${SPEEDUP:-20}          # the trace's clock
MOCKER_SPEEDUP=${MOCKER_SPEEDUP:-$SPEEDUP}   # the workers' simulated clock (1 = real time)
TOKEN_SCALE=${TOKEN_SCALE:-1}   # every length ÷ K: a trace block becomes 512/K tokens
RUNS=${RUNS:-1}
ROUTER_EXTRA=${ROUTER_EXTRA:-}  # more [router] lines, e.g. 'overlap_weight = 2.0' (kv_aware policies only)
BLOCKS=${BLOCKS:-4096}          # per worker, 16-token blocks (65,536 tokens)
MAX_OUTPUT=${MAX_OUTPUT:-64}
POLICIES=${POLICIES:-"kv_aware round_robin random"}
HOST_BLOCKS=${HOST_BLOCKS:-0}   # per worker: evicted blocks kept in a host-memory tier
KV_BYTES=${KV_BYTES:-1024}      # bytes each simulated block occupies (host tier memory)
PORT=${PORT:-8000}
[ -f "$TRACE" ] || { echo "replay_bench: no trace at $TRACE" >&2; exit 1; }

for run in $(seq 1 "$RUNS"); do
for policy in $POLICIES; do
  cfg=$(mktemp /tmp/dynamo-replay.XXXXXX.toml)
  cat >"$cfg" <<TOML
node_id = "replay"
namespace = "replay"
[nats]
url = "embedded"
[gateway]
listen = "127.0.0.1:$PORT"
max_body_bytes = 16777216
[router]
policy = "$policy"
$(case $policy in kv_aware*) printf '%s\n' "$ROUTER_EXTRA";; esac)
[[workers]]
count = 8
engine = "mocker"
context_length = 131072
[workers.mocker]
num_blocks = $BLOCKS
speedup = $MOCKER_SPEEDUP
offload_host_blocks = $HOST_BLOCKS
kv_bytes_per_block = $KV_BYTES
TOML
  "$BIN/dynamo-node" --config "$cfg" >"$cfg.log" 2>&1 &
  node=$!
  for _ in $(seq 1 300); do
    curl -s "http://127.0.0.1:$PORT/health" | grep -q '"workers":8' && break
    sleep 0.1
  done
  out=$("$BIN/dynamoctl" replay --trace "$TRACE" --url "http://127.0.0.1:$PORT" \
        --speedup "$SPEEDUP" --max-requests "$REQUESTS" --max-output "$MAX_OUTPUT" \
        --token-scale "$TOKEN_SCALE" --json || true)
  echo "run $run $policy $out"
  kill -TERM $node; wait $node || true
  # KEEP_LOG=PREFIX keeps each node's log (e.g. with DYNAMO_LOG=info,dynamo_router=debug).
  [ -n "${KEEP_LOG:-}" ] && cp "$cfg.log" "$KEEP_LOG.$policy.$run.log"
  rm -f "$cfg" "$cfg.log"
done
done
