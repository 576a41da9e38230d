# syntax=docker/dockerfile:1.7
# gpu-operator: a static (musl) binary on a distroless base with no shell and no libc.
# Build from the repository root:
#   docker build -f deploy/docker/gpu-operator.Dockerfile -t gpu-stack/gpu-operator .
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
RUN rustup target add x86_64-unknown-linux-musl \
 && apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile release-small --locked --target x86_64-unknown-linux-musl \
      -p gpu-stack-bins --bin gpu-operator \
 && cp target/x86_64-unknown-linux-musl/release-small/gpu-operator /gpu-operator

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /gpu-operator /usr/bin/gpu-operator
USER 65532:65532
ENTRYPOINT ["/usr/bin/gpu-operator"]
