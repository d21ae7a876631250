#!/usr/bin/env bash
# `make run-ha`: one NATS (JetStream) on 127.0.0.1:4222, two gateway+router
# nodes (127.0.0.1:8000 and :8001) and three worker nodes, each a separate
# dynamo-node process, from cluster-config/examples/ha/. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/release}
PORT=4222   # the configs in cluster-config/examples/ha/ name it
state=$(mktemp -d -t dynamo-ha.XXXXXX)
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
for cfg in worker-1 worker-2 worker-3 gateway-a gateway-b; do
    "$BIN/dynamo-node" --config "cluster-config/examples/ha/$cfg.toml" >"$state/$cfg.log" 2>&1 &
    pids+=($!)
    echo "$cfg: pid $! (log $state/$cfg.log)"
done
for port in 8000 8001; do
    for _ in $(seq 300); do
        curl -sf "127.0.0.1:$port/health" 2>/dev/null | grep -q '"workers":3' && break
        sleep 0.1
    done
done
echo "serving: http://127.0.0.1:8000 and http://127.0.0.1:8001 (nats $DYNAMO_NATS_URL)"
echo "try: $BIN/dynamoctl status; kill -9 a worker or a gateway mid-stream; dynamoctl drain WORKER"
wait -n "${pids[@]}" || true
echo "a process exited; see the logs in $state"
