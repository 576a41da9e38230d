#!/usr/bin/env bash
# Benchmarks the driver upgrade flow of the gpu-operator binary on the local
# test control plane: 1,000 fake GPU nodes (GPU_STACK_BENCH_NODES to change),
# each running a GPU pod under a PodDisruptionBudget, and a driver version
# bump with maxUnavailable 10%. Prints the time from the bump to every node
# upgrade-done and schedulable at the new revision, the most nodes
# unavailable (cordoned or NotReady) at once, from a node watch that counts
# after every change, and the operator's API requests during the rollout
# (its own gpu_stack_operator_api_requests_total, which counts every request
# it sends) per upgraded node, by verb and resource.
#
# Usage: scripts/bench-upgrade.sh          (starts and stops its own cluster)
#        set GPU_STACK_E2E_KUBECONFIG to reuse a running cluster.
# Everything listens on 127.0.0.1; the run stops by itself (the rollout may
# take at most 30 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

# The profile the operator image is built with (Cargo.toml, release-small).
nice cargo build --profile release-small -p gpu-stack-bins --bin gpu-operator
# Absolute: the test process runs from its own package directory.
export GPU_STACK_OPERATOR_BIN="$(realpath "${CARGO_TARGET_DIR:-target}")/release-small/gpu-operator"
# The operator's per-node log lines would be thousands; keep its warnings.
export GPU_STACK_E2E_OPERATOR_LOG="${GPU_STACK_E2E_OPERATOR_LOG:-warn}"

own_cluster=0
if [ -z "${GPU_STACK_E2E_KUBECONFIG:-}" ]; then
  state="$(mktemp -d)"
  own_cluster=1
  cleanup() { cargo xtask cluster down --state-dir "$state" >/dev/null 2>&1 || true; rm -rf "$state"; }
  trap cleanup EXIT
  cargo xtask cluster up --state-dir "$state" --port-base "${GPU_STACK_BENCH_PORT_BASE:-28450}" >&2
  export GPU_STACK_E2E_KUBECONFIG="$state/kubeconfig"
fi

timeout 3600 cargo test -p gpu-stack-e2e --test driver_upgrade_scale_e2e -- --ignored --nocapture \
  bench_driver_upgrade_1000_nodes 2>&1 \
  | grep --line-buffered -E '^bench:|test result|panicked|Error|WARN'
[ "$own_cluster" = 1 ] && echo "bench: cluster stopped" >&2 || true
