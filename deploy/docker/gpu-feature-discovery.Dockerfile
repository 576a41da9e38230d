# syntax=docker/dockerfile:1.7
# gpu-feature-discovery: loads the host's libnvidia-ml.so.1 at run time with dlopen, which a
# static musl binary cannot do, so it is a glibc binary on distroless/cc
# (glibc and libgcc only, no shell).
# Build from the repository root:
#   docker build -f deploy/docker/gpu-feature-discovery.Dockerfile -t gpu-stack/gpu-feature-discovery .
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpu-stack-bins --bin gpu-feature-discovery \
 && cp target/release/gpu-feature-discovery /gpu-feature-discovery

FROM gcr.io/distroless/cc-debian12
COPY --from=build /gpu-feature-discovery /usr/bin/gpu-feature-discovery
ENTRYPOINT ["/usr/bin/gpu-feature-discovery"]
