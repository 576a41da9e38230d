#!/usr/bin/env bash
# Benchmarks the gpu-operator binary on the local test control plane with
# 1,000 fake GPU nodes (GPU_STACK_BENCH_NODES to change): time from
# ClusterPolicy creation to status ready and to device-plugin pods Running on
# every node, against floors measured in the same run, before and after the
# operator (as many plain DaemonSets to the same nodes; the operator's own
# DaemonSets applied directly, so the same pods; with the node agent, the
# stack floor: as many plain DaemonSets as the policy runs without it), after
# one warm-up round that is not counted, each with the control plane's
# CPU-seconds per process and the bytes of its pods; the operator's peak RSS;
# the API requests it issued; and the writes it makes on a resync with
# nothing to change (must be 0).
#
# Usage: scripts/bench-operator.sh          (starts and stops its own cluster)
#        KUBECONFIG-less; set GPU_STACK_E2E_KUBECONFIG to reuse a running cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

# The profile the operator image is built with (Cargo.toml, release-small).
nice cargo build --profile release-small -p gpu-stack-bins --bin gpu-operator
# Absolute: the test process runs from its own package directory.
export GPU_STACK_OPERATOR_BIN="$(realpath "${CARGO_TARGET_DIR:-target}")/release-small/gpu-operator"

own_cluster=0
if [ -z "${GPU_STACK_E2E_KUBECONFIG:-}" ]; then
  state="$(mktemp -d)"
  own_cluster=1
  cleanup() { cargo xtask cluster down --state-dir "$state" >/dev/null 2>&1 || true; rm -rf "$state"; }
  trap cleanup EXIT
  cargo xtask cluster up --state-dir "$state" --port-base "${GPU_STACK_BENCH_PORT_BASE:-28440}" >&2
  export GPU_STACK_E2E_KUBECONFIG="$state/kubeconfig"
fi

cargo test -p gpu-stack-e2e --test operator_e2e -- --ignored --nocapture bench_operator_1000_nodes 2>&1 \
  | grep --line-buffered -E '^bench:|test result|panicked|Error'
[ "$own_cluster" = 1 ] && echo "bench: cluster stopped" >&2 || true
