#!/usr/bin/env bash
# GPU checks, in two steps because the GPU machine has no Rust toolchain
# and no libfabric:
#   scripts/gpu_checks.sh bundle   # here: release binaries + libfabric libs into .devbin/ (git-ignored: carry it)
#   scripts/gpu_checks.sh run OUT  # on the GPU machine, from the repository root
# `run` executes the `cuda` feature's transfer and weights tests, the
# device-memory transfer benchmark, the weights-to-device benchmark, the
# host transfer benchmark, and the configurator's per-operation
# calibration (PyTorch), writing logs and the calibration JSON to OUT.
# Steps (`tests`, `bench`, `calib`) can be run one call at a time, to fit
# a per-command time limit; each step's timeouts add up to at most 300 s.
set -u
cmd=${1:-}
case "$cmd" in
bundle)
    set -e
    cargo build --release -p dynamo-transfer --features cuda \
        --example device_transfer --example transfer_bench --test device
    rm -rf .devbin && mkdir -p .devbin/lib
    cp target/release/examples/device_transfer target/release/examples/transfer_bench .devbin/
    test_bin=$(ls -t target/release/deps/device-* | grep -v '\.d$' | head -1)
    cp "$test_bin" .devbin/device_tests
    cargo build --release -p dynamo-weights --features cuda \
        --example device_weights --test gpu_weights
    cp target/release/examples/device_weights .devbin/
    test_bin=$(ls -t target/release/deps/gpu_weights-* | grep -v '\.d$' | head -1)
    cp "$test_bin" .devbin/weights_device_tests
    strip .devbin/device_transfer .devbin/transfer_bench .devbin/device_tests \
        .devbin/device_weights .devbin/weights_device_tests
    # libfabric and everything it links, as this machine resolves them.
    ldd /lib/x86_64-linux-gnu/libfabric.so.1 | awk '/=> \//{print $3}' |
        grep -v -E '/libc\.so|/libm\.so|/ld-linux' | xargs -I{} cp -L {} .devbin/lib/
    cp -L /lib/x86_64-linux-gnu/libfabric.so.1 .devbin/lib/
    du -sh .devbin
    ;;
run)
    # `run OUT [STEP...]`: steps `tests`, `bench`, `calib` (default all,
    # in that order). Exits non-zero if any step failed or timed out.
    out=${2:?usage: gpu_checks.sh run OUT [tests|bench|calib]...}
    shift 2
    steps=${*:-tests bench calib}
    set -o pipefail
    failed=0
    step() { # NAME TIMEOUT LOG CMD...
        local name=$1 limit=$2 log=$3
        shift 3
        echo "== $name"
        if ! timeout "$limit" "$@" 2>&1 | tee "$out/$log"; then
            echo "!! $name failed" | tee -a "$out/failed.txt"
            failed=$((failed + 1))
        fi
    }
    export LD_LIBRARY_PATH="$PWD/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    echo "cores: $(nproc)" | tee -a "$out/gpu.txt"
    for s in $steps; do
        case "$s" in
        tests)
            step "device transfer tests" 60 device_tests.log .devbin/device_tests --test-threads=1
            step "weights device tests" 120 weights_device_tests.log \
                .devbin/weights_device_tests --test-threads=1
            ;;
        bench)
            step "device transfer benchmark" 60 device_transfer.log .devbin/device_transfer
            step "weights to device benchmark (98 MB and 2 GiB)" 120 device_weights.log \
                .devbin/device_weights
            step "host transfer benchmark (64 MiB, socket vs tcp vs shm)" 120 transfer_bench.log \
                .devbin/transfer_bench
            ;;
        calib)
            step "configurator calibration" 240 calib.log \
                python3 configurator/calibrate/gpu_ops.py "$out/calib.json"
            ;;
        *)
            echo "unknown step $s (tests, bench, calib)" >&2
            exit 2
            ;;
        esac
    done
    exit $((failed > 0))
    ;;
*)
    echo "usage: $0 bundle | run OUT [tests|bench|calib]..." >&2
    exit 2
    ;;
esac
