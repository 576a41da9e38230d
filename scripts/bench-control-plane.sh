#!/usr/bin/env bash
# Scale figure for the test control plane: 1,000 fake GPU nodes (NODES=N to
# change), one DaemonSet selecting them, time until its pods are Running on all.
# Uses a cluster started by `cargo xtask cluster up` when one runs; otherwise
# starts one and always stops it again (also on Ctrl-C or failure).
set -euo pipefail
cd "$(dirname "$0")/.."

NODES="${NODES:-1000}"
started_here=0
cleanup() {
  if [ "$started_here" = 1 ]; then
    cargo xtask cluster down || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Build the client first so the timed part does not compete with rustc.
cargo build -q -p gpu-stack-e2e --example control_plane_scale

if ! cargo xtask cluster status | grep -q '^running'; then
  t0=$(date +%s.%N)
  started_here=1
  cargo xtask cluster up >/dev/null
  echo "cluster started in $(echo "$(date +%s.%N) - $t0" | bc)s (including the build check)"
fi

cargo run -q -p gpu-stack-e2e --example control_plane_scale -- "$NODES"
