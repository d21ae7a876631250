#!/usr/bin/env bash
# GPU checks, in two steps because the GPU machine has no Rust toolchain
# and no libfabric:
#   scripts/gpu_checks.sh bundle   # here: release binaries + libfabric libs into .devbin/ (git-ignored: carry it)
#   scripts/gpu_checks.sh run OUT  # on the GPU machine, from the repository root
# `run` executes the `cuda` feature's transfer and weights tests, the
# device-memory transfer benchmark, the weights-to-device benchmark, the
# host transfer benchmark, and the configurator's per-operation
# calibration (PyTorch), writing logs and the calibration JSON to OUT.
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
    out=${2:?usage: gpu_checks.sh run OUT}
    export LD_LIBRARY_PATH="$PWD/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    echo "cores: $(nproc)" | tee -a "$out/gpu.txt"
    echo "== device transfer tests"
    timeout 60 .devbin/device_tests --test-threads=1 2>&1 | tee "$out/device_tests.log"
    echo "== weights device tests"
    timeout 120 .devbin/weights_device_tests --test-threads=1 2>&1 | tee "$out/weights_device_tests.log"
    echo "== configurator calibration"
    timeout 240 python3 configurator/calibrate/gpu_ops.py "$out/calib.json" 2>&1 | tee "$out/calib.log"
    echo "== device transfer benchmark"
    timeout 60 .devbin/device_transfer 2>&1 | tee "$out/device_transfer.log"
    echo "== weights to device benchmark (98 MB and 2 GiB)"
    timeout 180 .devbin/device_weights 2>&1 | tee "$out/device_weights.log"
    echo "== host transfer benchmark (64 MiB, socket vs tcp vs shm)"
    timeout 120 .devbin/transfer_bench 2>&1 | tee "$out/transfer_bench.log"
    ;;
*)
    echo "usage: $0 bundle | run OUT" >&2
    exit 2
    ;;
esac
