#!/usr/bin/env bash
# Starts a multi-node example on one machine: one NATS (JetStream) on
# 127.0.0.1:4222 and one dynamo-node process per config in
# cluster-config/examples/EXAMPLE/ (worker nodes first, then gateways),
# then waits until every gateway port reports WORKERS workers. Ctrl-C stops all.
#   make run-ha:     scripts/run_cluster.sh ha "8000 8001" 3
#   make run-disagg: scripts/run_cluster.sh disagg 8000 2
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLE=${1:?usage: run_cluster.sh EXAMPLE "PORTS" WORKERS}
PORTS=${2:?gateway ports}
WORKERS=${3:?worker count}
BIN=${BIN:-./target/release}
PORT=4222   # the configs in cluster-config/examples/$EXAMPLE/ name it
state=$(mktemp -d -t "dynamo-$EXAMPLE.XXXXXX")
pids=()
stop() {
    trap - INT TERM EXIT
    echo "stopping (nodes drain and deregister, then NATS stops)..."
    # Nodes first, while the bus is up; NATS (the first pid) last.
    for p in "${pids[@]:1}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]:1}"; do wait "$p" 2>/dev/null || true; done
    kill -TERM "${pids[0]}" 2>/dev/null || true
    wait 2>/dev/null || true
    echo "logs kept in $state"
    exit 0
}
trap stop INT TERM EXIT

if (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null; then
    echo "port $PORT is taken (another NATS?): stop it first" >&2
    exit 1
fi
nats-server -js -a 127.0.0.1 -p "$PORT" -sd "$state/jetstream" >"$state/nats.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break; sleep 0.1; done
export DYNAMO_NATS_URL="nats://127.0.0.1:$PORT" DYNAMO_STATE_DIR="$state"
dir="cluster-config/examples/$EXAMPLE"
for path in $(ls "$dir"/*.toml | grep -v /gateway) $(ls "$dir"/gateway*.toml); do
    cfg=$(basename "$path" .toml)
    "$BIN/dynamo-node" --config "$path" >"$state/$cfg.log" 2>&1 &
    pids+=($!)
    echo "$cfg: pid $! (log $state/$cfg.log)"
done
for port in $PORTS; do
    for _ in $(seq 600); do
        curl -sf "127.0.0.1:$port/health" 2>/dev/null | grep -q "\"workers\":$WORKERS" && break
        sleep 0.1
    done
done
echo "serving on 127.0.0.1 port(s) $PORTS (nats $DYNAMO_NATS_URL)"
echo "try: $BIN/dynamoctl status; kill -9 a worker or a gateway mid-stream; dynamoctl drain WORKER"
wait -n "${pids[@]}" || true
echo "a process exited; see the logs in $state"
