# syntax=docker/dockerfile:1.7
# gpu-node-agent (the device plugin, GFD, the exporter and the MIG manager
# in one process): loads the host's libnvidia-ml.so.1 at run time with dlopen, which a
# static musl binary cannot do, so it is a glibc binary on distroless/cc
# (glibc and libgcc only, no shell).
# Build from the repository root:
#   docker build -f deploy/docker/gpu-node-agent.Dockerfile -t gpu-stack/gpu-node-agent .
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpu-stack-bins --bin gpu-node-agent \
 && cp target/release/gpu-node-agent /gpu-node-agent

FROM gcr.io/distroless/cc-debian12
COPY --from=build /gpu-node-agent /usr/bin/gpu-node-agent
ENTRYPOINT ["/usr/bin/gpu-node-agent"]
