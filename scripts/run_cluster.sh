#!/usr/bin/env bash
# Starts a labelled cluster on one machine from a deployment spec: NATS
# with JetStream (one server, or a cluster of NATS_SERVERS), four dynamo-node processes that join it with labels and no
# workers of their own (racks r1 and r2, two hosts each, SLOTS slots per
# node; n1 and n2 also run a placement controller), then `dynamoctl apply`
# of the spec. It waits until every gateway port reports WORKERS workers,
# and keeps the cluster up: a node (or NATS) that exits is reported and
# started again, while the others keep serving.
# Ctrl-C stops everything (nodes drain and deregister first, NATS last).
#   make run-cluster: scripts/run_cluster.sh cluster 8000 2
#   make run-ha:      NATS_SERVERS=3 scripts/run_cluster.sh ha "8000 8001" 3
#   make run-disagg:  scripts/run_cluster.sh disagg 8000 2
# SPEC is cluster-config/examples/SPEC.yaml, or a path to a spec.
# Node labels: n1 zone=z1,rack=r1,host=h1,edge=yes,gateway=0 (listens on
# the first port), n2 ...,host=h2,edge=yes,gateway=1 (the second port),
# n3 and n4 rack=r2,edge=no: specs pin frontends with `node_selector`.
# Environment:
#   BIN=DIR             binaries (default ./target/release)
#   NATS_PORT=N         NATS port (default 4222; server i of a cluster: N+i,
#                       its cluster port N+100+i, its monitoring port N+200+i)
#   NATS_SERVERS=N      NATS servers: 1, or 3+ for a JetStream cluster whose
#                       streams and buckets are R3; every node is given every
#                       server's URL (default 1)
#   SLOTS=N             slots per node (default 4)
#   RESTART=0           report exited nodes but do not restart them
#   DRAIN_S=N           on Ctrl-C, kill a node still draining after N s (60)
#   DYNAMO_STATE_DIR=D  where the NATS URL (and the CA and admin seed) are
#                       written for `dynamoctl` (default: where it looks)
#   SECURE=0            plain NATS with no users (default 1: TLS from a CA
#                       made here, and one NATS user per role from
#                       `dynamoctl nats-auth`; every node connects with the
#                       CA and its roles' seeds)
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${1:?usage: run_cluster.sh SPEC "PORTS" WORKERS}
PORTS=${2:?gateway ports}
WORKERS=${3:?worker count}
BIN=${BIN:-./target/release}
NATS_PORT=${NATS_PORT:-4222}
NATS_SERVERS=${NATS_SERVERS:-1}
SLOTS=${SLOTS:-4}
RESTART=${RESTART:-1}
DRAIN_S=${DRAIN_S:-60}
STATE_DIR=${DYNAMO_STATE_DIR:-${TMPDIR:-/tmp}/dynamo-state}
SECURE=${SECURE:-1}
spec="cluster-config/examples/$SPEC.yaml"
[ -f "$spec" ] || spec="$SPEC"
[ -f "$spec" ] || { echo "no spec cluster-config/examples/$SPEC.yaml or $SPEC" >&2; exit 2; }
# The spec is checked before anything starts.
"$BIN/dynamoctl" apply -f "$spec" --dry-run
name=$(basename "$spec" .yaml)
run=$(mktemp -d -t "dynamo-$name.XXXXXX")
mkdir -p -m 700 "$STATE_DIR"
namespace=default
url_file="$STATE_DIR/$namespace.nats-url"
ca_state="$STATE_DIR/$namespace.nats-ca.pem"
creds_state="$STATE_DIR/$namespace.nats-creds"
# Secure by default: a CA and server certificate for this machine, and a
# NATS user per role (each allowed only its own subjects in the namespace).
scheme=nats
server_security=""
route_auth=""
route_security=""
node_security=()
if [ "$SECURE" = 1 ]; then
    "$BIN/dynamoctl" nats-auth --out "$run/auth" --namespace "$namespace" \
        --tls-names 127.0.0.1,localhost >/dev/null
    scheme=tls
    server_security="tls { cert_file: \"$run/auth/tls/cert.pem\", key_file: \"$run/auth/tls/key.pem\", timeout: 5 }
include \"auth/auth.conf\""
    # Routes between servers: TLS both ways and a password of their own.
    route_pw=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
    route_auth="route:$route_pw@"
    route_security="authorization { user: route, password: \"$route_pw\" }
  tls { cert_file: \"$run/auth/tls/cert.pem\", key_file: \"$run/auth/tls/key.pem\", ca_file: \"$run/auth/tls/ca.pem\", timeout: 5 }"
    export DYNAMO_NATS_CA="$run/auth/tls/ca.pem"
    # dynamoctl is the operator (admin); nodes get their roles' seeds.
    export DYNAMO_NATS_CREDENTIALS="$run/auth/$namespace.admin"
    node_security=(--nats-ca "$DYNAMO_NATS_CA" --nats-credentials "$run/auth/$namespace")
fi

read -r -a ports <<<"$PORTS"
p1=${ports[0]:?"give at least one gateway port"}
p2=${ports[1]:-$((p1 + 1))}
configs=(n1 n2 n3 n4)
declare -A labels=(
    [n1]="zone=z1,rack=r1,host=h1,edge=yes,gateway=0"
    [n2]="zone=z1,rack=r1,host=h2,edge=yes,gateway=1"
    [n3]="zone=z1,rack=r2,host=h3,edge=no"
    [n4]="zone=z1,rack=r2,host=h4,edge=no"
)
declare -A extra=(
    [n1]="--roles controller --http-listen 127.0.0.1:$p1"
    [n2]="--roles controller --http-listen 127.0.0.1:$p2"
    [n3]=""
    [n4]=""
)

declare -A pid
stopping=0

# Each process runs in a session of its own: the terminal's Ctrl-C reaches
# this script only, which stops the nodes first and NATS last.
nats_names=()
for i in $(seq 0 $((NATS_SERVERS - 1))); do nats_names+=("nats$i"); done
nats_urls=$(for i in $(seq 0 $((NATS_SERVERS - 1))); do printf '%s://127.0.0.1:%s,' "$scheme" $((NATS_PORT + i)); done)
nats_urls=${nats_urls%,}

# Starts NATS server `natsI` (one alone, or one member of the cluster).
start_nats() {
    local i=${1#nats} port=$((NATS_PORT + ${1#nats}))
    if [ "$NATS_SERVERS" = 1 ]; then
        cat >"$run/$1.conf" <<CONF
listen: "127.0.0.1:$port"
jetstream { store_dir: "$run/jetstream" }
$server_security
CONF
    else
        local routes="" j
        for j in $(seq 0 $((NATS_SERVERS - 1))); do
            [ "$j" = "$i" ] || routes="$routes nats-route://${route_auth}127.0.0.1:$((NATS_PORT + 100 + j)),"
        done
        cat >"$run/$1.conf" <<CONF
server_name: $1
listen: "127.0.0.1:$port"
http: "127.0.0.1:$((NATS_PORT + 200 + i))"
jetstream { store_dir: "$run/jetstream$i" }
cluster {
  name: dynamo, listen: "127.0.0.1:$((NATS_PORT + 100 + i))", routes: [${routes%,}]
  $route_security
}
$server_security
CONF
    fi
    setsid nats-server -c "$run/$1.conf" >>"$run/$1.log" 2>&1 &
    pid[$1]=$!
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return; sleep 0.1; done
    echo "NATS server $1 did not start; see $run/$1.log" >&2
}

start_node() {
    # shellcheck disable=SC2086 # extra holds separate flags
    setsid "$BIN/dynamo-node" --join "$nats_urls" --namespace "$namespace" \
        --node-id "$1" --labels "${labels[$1]}" --slots "$SLOTS" "${node_security[@]}" ${extra[$1]} >>"$run/$1.log" 2>&1 &
    pid[$1]=$!
    echo "$1: pid ${pid[$1]} (log $run/$1.log)"
}

# Signals one process by name, if it runs (an exited one has no pid).
signal() {
    local p=${pid[$2]:-}
    [ -n "$p" ] && kill "-$1" "$p" 2>/dev/null || true
}

# A second Ctrl-C while draining: kill everything now.
force_stop() {
    echo "stopping now (SIGKILL)"
    for c in "${configs[@]}" "${nats_names[@]}"; do signal KILL "$c"; done
}

stop() {
    trap force_stop INT TERM
    trap - EXIT
    stopping=1
    echo "stopping (nodes drain and deregister, then NATS stops; Ctrl-C again to kill)..."
    for c in "${configs[@]}"; do signal TERM "$c"; done
    # Nodes end within their shutdown grace; one that outlives DRAIN_S is killed.
    local deadline=$((SECONDS + DRAIN_S)) c p
    for c in "${configs[@]}"; do
        p=${pid[$c]:-}
        [ -n "$p" ] || continue
        while kill -0 "$p" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2 || true; done
        if kill -0 "$p" 2>/dev/null; then
            echo "$c did not stop within ${DRAIN_S}s: killing it"
            signal KILL "$c"
        fi
        wait "$p" 2>/dev/null || true
    done
    for c in "${nats_names[@]}"; do signal TERM "$c"; done
    for c in "${nats_names[@]}"; do [ -n "${pid[$c]:-}" ] && { wait "${pid[$c]}" 2>/dev/null || true; }; done
    if [ "$(cat "$url_file" 2>/dev/null)" = "$nats_urls" ]; then
        rm -rf "$url_file" "$ca_state" "$creds_state"
    fi
    echo "stopped; logs kept in $run"
    exit 0
}
trap stop INT TERM EXIT

for i in $(seq 0 $((NATS_SERVERS - 1))); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$((NATS_PORT + i))") 2>/dev/null; then
        echo "port $((NATS_PORT + i)) is taken (another NATS?): stop it first, or set NATS_PORT" >&2
        exit 1
    fi
done
for c in "${nats_names[@]}"; do start_nats "$c"; done
# A cluster places R3 streams only once its JetStream meta group has a
# leader and every peer is current (monitoring port NATS_PORT+200).
if [ "$NATS_SERVERS" -gt 1 ]; then
    for _ in $(seq 600); do
        jsz=$(curl -s "127.0.0.1:$((NATS_PORT + 200))/jsz" 2>/dev/null || true)
        current=$(grep -o '"current": *true' <<<"$jsz" | wc -l || true)
        grep -q '"leader": *"[^"]' <<<"$jsz" && [ "$current" -ge $((NATS_SERVERS - 1)) ] && break
        sleep 0.1
    done
    echo "NATS cluster of $NATS_SERVERS servers ready ($nats_urls)"
fi
export DYNAMO_NATS_URL="$nats_urls"
echo "$DYNAMO_NATS_URL" >"$url_file"
# dynamoctl finds the CA and the admin seed beside the URL.
rm -rf "$ca_state" "$creds_state"
if [ "$SECURE" = 1 ]; then
    cp "$DYNAMO_NATS_CA" "$ca_state"
    mkdir -m 700 "$creds_state"
    cp "$DYNAMO_NATS_CREDENTIALS/admin.nk" "$creds_state/"
    chmod 600 "$creds_state/admin.nk"
fi
for c in "${configs[@]}"; do start_node "$c"; done
# Every node in the inventory before the spec is placed (else the first
# nodes to join take every replica, and nothing moves them later).
for _ in $(seq 300); do
    joined=$("$BIN/dynamoctl" status --json --nats "$DYNAMO_NATS_URL" --namespace "$namespace" 2>/dev/null |
        grep -c '"free_slots"' || true)
    [ "$joined" -ge "${#configs[@]}" ] && break
    sleep 0.1
done
"$BIN/dynamoctl" apply -f "$spec" --nats "$DYNAMO_NATS_URL" --namespace "$namespace"
for port in $PORTS; do
    for _ in $(seq 600); do
        curl -sf "127.0.0.1:$port/health" 2>/dev/null | grep -q "\"workers\":$WORKERS" && break
        sleep 0.1
    done
done
echo "serving on 127.0.0.1 port(s) $PORTS (nats $DYNAMO_NATS_URL)"
echo "try: $BIN/dynamoctl describe deployment $(sed -n 's/^name: *//p' "$spec" | head -n1); dynamoctl scale NAME/SERVICE N; kill -9 a node mid-stream"

# Keep the cluster up: report whatever exits, and start it again.
while [ "$stopping" = 0 ]; do
    for c in "${nats_names[@]}" "${configs[@]}"; do
        p=${pid[$c]}
        [ -n "$p" ] || continue
        kill -0 "$p" 2>/dev/null && continue
        status=0
        wait "$p" 2>/dev/null || status=$?
        [ "$stopping" = 1 ] && break
        echo "$c (pid $p) exited with status $status; see its log in $run"
        if [ "$RESTART" = 1 ]; then
            echo "$c: restarting"
            case $c in nats*) start_nats "$c" ;; *) start_node "$c" ;; esac
        else
            pid[$c]=""
        fi
    done
    sleep 0.5 &
    wait $! 2>/dev/null || true
done
