# syntax=docker/dockerfile:1.7
# gpu-mig-manager: loads the host's libnvidia-ml.so.1 at run time with dlopen, which a
# static musl binary cannot do, so it is a glibc binary on distroless/cc
# (glibc and libgcc only, no shell).
# Build from the repository root:
#   docker build -f deploy/docker/gpu-mig-manager.Dockerfile -t gpu-stack/gpu-mig-manager .
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpu-stack-bins --bin gpu-mig-manager \
 && cp target/release/gpu-mig-manager /gpu-mig-manager

FROM gcr.io/distroless/cc-debian12
COPY --from=build /gpu-mig-manager /usr/bin/gpu-mig-manager
ENTRYPOINT ["/usr/bin/gpu-mig-manager"]
