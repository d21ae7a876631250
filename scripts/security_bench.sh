#!/usr/bin/env bash
# The cost of security, side by side in one run (BENCHMARKS.md, "Security
# overhead"): two bench clusters (bench.toml: embedded NATS, gateway +
# router, two mocker workers at no simulated delay) run at once,
#   off: plain HTTP, no API keys, NATS without TLS or users;
#   on:  HTTPS (a CA and certificate made here), an API key on every
#        request, NATS with TLS and a user per role (the default); the
#        parts can be left out one by one: HTTPS=0, KEYS=0, NATS_TLS=0,
#        NATS_USERS=0;
# TOPOLOGY=fleet runs each cluster as a fleet does instead: its own
# nats-server (TLS and the per-role users of `dynamoctl nats-auth` for
# "on"), a frontend node (gateway + router) and a worker node (the two
# mocker workers), so gateway and workers talk over separate connections
# whatever is on; CPU is then both nodes' and the server's.
# MEASURE=instructions (node topology) counts instead of timing: both nodes
# run under valgrind's callgrind, and each mode's REQUESTS (default 1,000
# here) are counted in instructions executed by dynamo-node, once per side.
# Instructions do not depend on what else runs on the machine, so this
# separates what security makes the node do from how a shared 2-core host
# slows it (BENCHMARKS.md, "Security overhead"). The NATS server (Go, not
# run under valgrind) is left out of the count.
# BIN_ON (default BIN) runs the "on" nodes from another build: with every
# part off (HTTPS=0 KEYS=0 NATS_TLS=0 NATS_USERS=0) it compares two builds
# side by side, the same way (BENCHMARKS.md, "Serving path", mimalloc).
# `dynamoctl bench` alternates between them for ROUNDS rounds (each
# round: non-streaming then streaming, REQUESTS chat requests at
# CONCURRENCY, keep-alive connections as real clients use). It reports
# latency p50 and the server processes' CPU-ms per request (dynamo-node +
# its nats-server, from /proc), and on ÷ off for both.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./target/release}
BIN_ON=${BIN_ON:-$BIN}
MEASURE=${MEASURE:-time}
case "$MEASURE" in
time) REQUESTS=${REQUESTS:-2000} ;;
instructions) REQUESTS=${REQUESTS:-1000} CONCURRENCY=${CONCURRENCY:-16} ;;
*)
  echo "security_bench.sh: MEASURE is time or instructions, not $MEASURE" >&2
  exit 2
  ;;
esac
CONCURRENCY=${CONCURRENCY:-64}
ROUNDS=${ROUNDS:-3}
PORT_OFF=${PORT_OFF:-8010}
PORT_ON=${PORT_ON:-8011}
work=$(mktemp -d -t dynamo-security-bench.XXXXXX)
. scripts/lib_node.sh
machine

# TLS files and an API key for the "on" cluster.
"$BIN/dynamoctl" nats-auth --out "$work/pki" --namespace bench --tls-names 127.0.0.1,localhost >/dev/null 2>&1
key_out=$("$BIN/dynamoctl" keys new --name bench 2>/dev/null)
key=$(head -n1 <<<"$key_out")
tail -n +2 <<<"$key_out" >"$work/keys.toml"

# Parts of "on" can be left off to see what each costs (all 1 by default).
HTTPS=${HTTPS:-1} KEYS=${KEYS:-1} NATS_TLS=${NATS_TLS:-1} NATS_USERS=${NATS_USERS:-1}
b() { [ "$1" = 1 ] && echo true || echo false; }
gateway_on=""
[ "$HTTPS" = 1 ] && gateway_on="$gateway_on\ntls_cert = \"$work/pki/tls/cert.pem\"\ntls_key = \"$work/pki/tls/key.pem\""
[ "$KEYS" = 1 ] && gateway_on="$gateway_on\napi_keys_file = \"$work/keys.toml\""
sed -e "s/127.0.0.1:8000/127.0.0.1:$PORT_OFF/" \
    -e 's/^url = "embedded"$/url = "embedded"\ntls = false\nauth = false/' \
    cluster-config/examples/bench.toml >"$work/off.toml"
sed -e "s/127.0.0.1:8000/127.0.0.1:$PORT_ON/" \
    -e "s/^url = \"embedded\"$/url = \"embedded\"\ntls = $(b "$NATS_TLS")\nauth = $(b "$NATS_USERS")/" \
    -e "s|^listen = \"127.0.0.1:$PORT_ON\"$|listen = \"127.0.0.1:$PORT_ON\"$gateway_on|" \
    cluster-config/examples/bench.toml >"$work/on.toml"
grep -q "auth = $(b "$NATS_USERS")" "$work/on.toml" && grep -q 'tls = false' "$work/off.toml" || {
    echo "security_bench.sh: could not derive the configs from bench.toml" >&2
    exit 1
}
echo "on: HTTPS=$HTTPS KEYS=$KEYS NATS_TLS=$NATS_TLS NATS_USERS=$NATS_USERS"
echo "builds: off $BIN, on $BIN_ON"
scheme_on=http
[ "$HTTPS" = 1 ] && scheme_on=https

TOPOLOGY=${TOPOLOGY:-node}
case "$TOPOLOGY" in node | fleet) ;; *)
  echo "security_bench.sh: TOPOLOGY is node or fleet, not $TOPOLOGY" >&2
  exit 2
  ;;
esac
echo "topology: $TOPOLOGY"
if [ "$MEASURE" = instructions ]; then
  [ "$TOPOLOGY" = node ] || { echo "security_bench.sh: MEASURE=instructions needs TOPOLOGY=node" >&2; exit 2; }
  command -v callgrind_control >/dev/null || { echo "security_bench.sh: MEASURE=instructions needs valgrind" >&2; exit 2; }
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
start() { # NAME CONFIG HEALTH_URL [curl args]: sets the pid in $started
  local name=$1 config=$2 health=$3
  shift 3
  local bin=$BIN wrap=()
  [ "$name" = on ] && bin=$BIN_ON
  [ "$MEASURE" = instructions ] &&
    wrap=(valgrind --tool=callgrind --instr-atstart=no "--callgrind-out-file=$work/cg-$name.%p")
  DYNAMO_STATE_DIR="$work/state-$name" "${wrap[@]}" "$bin/dynamo-node" --config "$config" >"$work/$name.log" 2>&1 &
  started=$!
  pids+=("$started")
  for _ in $(seq 1 300); do
    if curl -s "$@" "$health" | grep -q '"workers":2'; then return; fi
    kill -0 "$started" 2>/dev/null || { echo "$name node died; see $work/$name.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "$name node not ready; see $work/$name.log" >&2
  exit 1
}
if [ "$TOPOLOGY" = node ]; then
  start off "$work/off.toml" "http://127.0.0.1:$PORT_OFF/health"
  node_off=$started
  start on "$work/on.toml" "$scheme_on://127.0.0.1:$PORT_ON/health" --cacert "$work/pki/tls/ca.pem"
  node_on=$started
  nats_off=$(pgrep -P "$node_off" nats-server)
  nats_on=$(pgrep -P "$node_on" nats-server)
else
  # One nats-server per cluster; "on" with TLS and users as configured.
  free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  fleet() { # NAME TLS USERS GATEWAY_TOML: sets nats_pid, front_pid, work_pid
    local name=$1 tls=$2 users=$3 gateway=$4 port scheme=nats nats_access=""
    port=$(free_port)
    {
      echo "listen: \"127.0.0.1:$port\""
      echo "jetstream { store_dir: \"$work/js-$name\" }"
      if [ "$tls" = 1 ]; then
        echo "tls { cert_file: \"$work/pki/tls/cert.pem\", key_file: \"$work/pki/tls/key.pem\", timeout: 5 }"
      fi
      [ "$users" = 1 ] && echo "include \"pki/auth.conf\""
    } >"$work/nats-$name.conf"
    nats-server -c "$work/nats-$name.conf" >"$work/nats-$name.log" 2>&1 &
    nats_pid=$!
    pids+=("$nats_pid")
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    if [ "$tls" = 1 ]; then
      scheme=tls
      nats_access="$nats_access\nca_file = \"$work/pki/tls/ca.pem\""
    fi
    [ "$users" = 1 ] && nats_access="$nats_access\ncredentials = \"$work/pki/bench\""
    local nats_block="[nats]\nurl = \"$scheme://127.0.0.1:$port\"$nats_access"
    printf "node_id = \"front-$name\"\nnamespace = \"bench\"\n\n$nats_block\n\n[gateway]$gateway\n\n[router]\npolicy = \"least_loaded\"\n" >"$work/front-$name.toml"
    printf "node_id = \"work-$name\"\nnamespace = \"bench\"\n\n$nats_block\n\n[[workers]]\ncount = 2\nengine = \"mocker\"\nmodel = \"smollm2-135m-instruct\"\n\n[workers.mocker]\nspeedup = 0.0\n" >"$work/work-$name.toml"
    local bin=$BIN
    [ "$name" = on ] && bin=$BIN_ON
    DYNAMO_STATE_DIR="$work/state-work-$name" "$bin/dynamo-node" --config "$work/work-$name.toml" >"$work/work-$name.log" 2>&1 &
    work_pid=$!
    pids+=("$work_pid")
  }
  fleet off 0 0 "\nlisten = \"127.0.0.1:$PORT_OFF\""
  nats_off=$nats_pid
  start off "$work/front-off.toml" "http://127.0.0.1:$PORT_OFF/health"
  node_off="$started $work_pid"
  fleet on "$NATS_TLS" "$NATS_USERS" "\nlisten = \"127.0.0.1:$PORT_ON\"${gateway_on}"
  nats_on=$nats_pid
  start on "$work/front-on.toml" "$scheme_on://127.0.0.1:$PORT_ON/health" --cacert "$work/pki/tls/ca.pem"
  node_on="$started $work_pid"
fi
TCK=$(getconf CLK_TCK)
ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }

bench() { # off|on MODE: prints "p50_ms cpu_ms_per_request node_share"
  local url args=() node nats n0 s0 n1 s1 out k=""
  if [ "$1" = on ]; then
    url="$scheme_on://127.0.0.1:$PORT_ON"
    node=$node_on nats=$nats_on
    [ "$HTTPS" = 1 ] && args+=(--ca-file "$work/pki/tls/ca.pem")
    # The key goes by the environment, not the command line.
    [ "$KEYS" = 1 ] && k=$key
  else
    url="http://127.0.0.1:$PORT_OFF"
    node=$node_off nats=$nats_off
  fi
  # shellcheck disable=SC2086 # $node may name two processes (fleet)
  n0=$(ticks $node) s0=$(ticks "$nats")
  # shellcheck disable=SC2086 # $2 is one optional flag
  out=$(DYNAMO_API_KEY=$k "$BIN/dynamoctl" bench --url "$url" "${args[@]}" --concurrency "$CONCURRENCY" \
      --requests "$REQUESTS" --max-tokens 16 --prompt-tokens 60 $2 --json)
  # shellcheck disable=SC2086
  n1=$(ticks $node) s1=$(ticks "$nats")
  python3 - "$out" "$n0" "$n1" "$s0" "$s1" "$TCK" "$REQUESTS" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
n0, n1, s0, s1, tck, n = map(float, sys.argv[2:])
assert r["ok"] == n, f"{r['ok']} of {n} requests succeeded: {r.get('first_error')}"
node, nats = (n1 - n0) * 1000 / tck / n, (s1 - s0) * 1000 / tck / n
print(f"{r['latency_p50_ms']:.2f} {node + nats:.3f} {node:.3f} {nats:.3f}")
PY
}

# Warm both (tokenizers, connections, TLS sessions).
bench off "" >/dev/null
bench on "" >/dev/null

if [ "$MEASURE" = instructions ]; then
  # Instrument from here on, warm again under instrumentation, then count
  # each mode on each side: zero the counters, run, dump, read the total.
  callgrind_control -i on "$node_off" >/dev/null 2>&1
  callgrind_control -i on "$node_on" >/dev/null 2>&1
  bench off "" >/dev/null
  bench on "" >/dev/null
  count() { # off|on MODE: prints instructions per request
    local pid dump
    [ "$1" = on ] && pid=$node_on || pid=$node_off
    callgrind_control -z "$pid" >/dev/null 2>&1
    bench "$1" "$2" >/dev/null
    callgrind_control -d "$pid" >/dev/null 2>&1
    dump=$(ls -t "$work/cg-$1.$pid".* | head -n1)
    awk -v n="$REQUESTS" '/^totals:/ {printf "%.0f", $2 / n}' "$dump"
  }
  for mode in "" "--stream"; do
    name=${mode:-non-stream}
    name=${name#--}
    o=$(count off "$mode") n=$(count on "$mode")
    echo "$name: dynamo-node instructions per request  off $o | on $n | on/off $(awk -v a="$n" -v b="$o" 'BEGIN {printf "%.3f", a / b}') (CPU target <= 1.10)"
  done
  exit 0
fi
for mode in "" "--stream"; do
  name=${mode:-non-stream}
  name=${name#--}
  offs=() ons=()
  for r in $(seq "$ROUNDS"); do
    # Alternate which goes first, so drift on a noisy host falls on both.
    if [ $((r % 2)) = 1 ]; then
      o=$(bench off "$mode"); n=$(bench on "$mode")
    else
      n=$(bench on "$mode"); o=$(bench off "$mode")
    fi
    echo "$name round $r: p50_ms cpu_ms_per_req (node nats): off $o | on $n"
    offs+=("$o"); ons+=("$n")
  done
  python3 - "$name" "${offs[*]}" "${ons[*]}" <<'PY'
import statistics, sys
name = sys.argv[1]
off = [float(x) for x in sys.argv[2].split()]
on = [float(x) for x in sys.argv[3].split()]
p50 = lambda v: statistics.median(v[0::4]); cpu = lambda v: statistics.median(v[1::4])
print(f"{name}: median of rounds  off p50 {p50(off):.2f} ms, {cpu(off):.3f} CPU-ms/req | "
      f"on p50 {p50(on):.2f} ms, {cpu(on):.3f} CPU-ms/req | "
      f"on/off p50 {p50(on)/p50(off):.3f} (target <= 1.05), CPU {cpu(on)/cpu(off):.3f} (target <= 1.10)")
PY
done
