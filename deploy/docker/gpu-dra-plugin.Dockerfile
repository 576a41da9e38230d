# syntax=docker/dockerfile:1.7
# gpu-dra-plugin: loads the host's libnvidia-ml.so.1 at run time with dlopen, which a
# static musl binary cannot do, so it is a glibc binary on distroless/cc
# (glibc and libgcc only, no shell).
# Build from the repository root:
#   docker build -f deploy/docker/gpu-dra-plugin.Dockerfile -t gpu-stack/gpu-dra-plugin .
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpu-stack-bins --bin gpu-dra-plugin \
 && cp target/release/gpu-dra-plugin /gpu-dra-plugin

FROM gcr.io/distroless/cc-debian12
COPY --from=build /gpu-dra-plugin /usr/bin/gpu-dra-plugin
ENTRYPOINT ["/usr/bin/gpu-dra-plugin"]
