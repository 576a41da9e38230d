#!/usr/bin/env bash
# Figures of the stack on the real test node (whole processes, wall clock):
#   - real node start (namespaces, containerd, images imported, kubelet) -> Node Ready
#   - helm install -> ClusterPolicy ready with the node's GPUs allocatable
#   - the toolkit agent: start -> containerd configured for CDI, and its restarts
#     (once on install; none when it runs again on a node already configured)
#   - a node joining the cluster -> a GPU pod Running on it (images present)
#   - kubelet restart -> the device plugin registered again
#   - RSS (VmRSS, VmHWM) of every operand process on the node
# Starts its own cluster (port base 29440, .cache/bench-real-node) and stops it.
# Needs root, like `cargo xtask test`. Usage: scripts/bench-real-node.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/gpu-stack/target}"
state="$root/.cache/bench-real-node"
export GPU_STACK_CLUSTER_PORT_BASE=29440 GPU_STACK_CLUSTER_DIR="$state"
node_dir="$state/node"
helm="$(tools/helm/build.sh)"
# The releases of GPU_STACK_KUBE_VERSION and GPU_STACK_CONTAINERD_VERSION
# (default 1.37 and 2.3), as for `cargo xtask cluster up`.
kubectl="$(cargo xtask cluster bin-dir)/kubectl"
node=gpu-node-real

cleanup() { cargo xtask cluster down >/dev/null 2>&1 || true; }
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
k() { "$kubectl" --kubeconfig="$state/kubeconfig" "$@"; }

wait_until() { # seconds, description, command...
  local limit=$1 what=$2; shift 2
  local start; start=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) - start > limit )); then echo "timed out waiting for $what" >&2; exit 1; fi
    sleep 0.2
  done
}

gpu_pod() { # name
  cat <<EOF | k apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: default}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: work
    image: localhost/gpu-stack/busybox:0.1.0
    command: ["sleep", "3600"]
    resources: {limits: {nvidia.com/gpu: 1}}
EOF
}
pod_running() { [ "$(k get pod "$1" -o jsonpath='{.status.phase}')" = Running ]; }
# Ready as a user means it: the node is a GPU node, the policy says ready and
# the GPUs are allocatable (a policy is also "ready" before any GPU node is found).
policy_ready() {
  [ "$(k get node "$node" -o jsonpath='{.metadata.labels.nvidia\.com/gpu\.present}')" = true ] &&
    [ "$(k get clusterpolicy cluster-policy -o jsonpath='{.status.state}')" = ready ] &&
    [ "$(k get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" = 2 ]
}

cargo build -q -p xtask -p gpu-stack-bins --bins
cargo xtask cluster down >/dev/null 2>&1 || true
cargo xtask cluster up --real-node 2>&1 | grep -E "Ready in|cluster ready" | sed 's/^/figure: /'

t0=$(now)
"$helm" install gpu-stack deploy/helm/gpu-stack --kubeconfig="$state/kubeconfig" \
  --namespace gpu-operator --create-namespace --values tests/real-node/values.yaml >/dev/null
wait_until 300 "the ClusterPolicy to be ready" policy_ready
echo "figure: helm install -> GPU node labelled, ClusterPolicy ready, GPUs allocatable: $(elapsed "$t0" "$(now)") s"
# The toolkit agent logs how long it took and how many runtime restarts it made.
toolkit_logs() {
  cat "$node_dir"/root/var/log/pods/gpu-operator_nvidia-container-toolkit-daemonset-*/nvidia-container-toolkit/*.log 2>/dev/null |
    sed -E 's/\x1b\[[0-9;]*m//g'
}
toolkit_figure() {
  toolkit_logs | grep -E "container runtime (configured|already configured)" | tail -1 |
    sed -E 's/.*took_ms=([0-9]+).*/\1/; t; s/.*/?/' | tr -d '\n'
}
echo "figure: toolkit agent start -> containerd configured for CDI: $(toolkit_figure) ms, restarts: $(toolkit_logs | grep -o 'restarts=[0-9]*' | tail -1 | cut -d= -f2)"

# A node joins: as after a reboot, its kubelet and every container are gone,
# and so is its Node object (and with it its pods); then the kubelet starts
# and registers it anew, images present. The GPU pod waits for it.
kill "$(cat "$state/pids/kubelet.pid")"
sleep 1
for procs in $(find /sys/fs/cgroup/pids/gpu-stack-29440 -name cgroup.procs 2>/dev/null); do
  xargs -r kill -9 <"$procs" 2>/dev/null || true
done
k delete node "$node" --wait=true >/dev/null
wait_until 180 "the old node's pods to go" sh -c \
  "[ -z \"\$($kubectl --kubeconfig=$state/kubeconfig get pods -n gpu-operator --field-selector spec.nodeName=$node -o name)\" ]"
gpu_pod join-probe
setsid sh "$node_dir/kubelet.sh" </dev/null >/dev/null 2>&1 &
echo $! >"$state/pids/kubelet.pid"
t0=$(now)
wait_until 300 "a GPU pod on the joined node" pod_running join-probe
echo "figure: node joins -> GPU pod Running: $(elapsed "$t0" "$(now)") s"
wait_until 300 "the ClusterPolicy to be ready again" policy_ready
echo "figure: toolkit agent on the rejoined node (nothing changed): $(toolkit_figure) ms, $(toolkit_logs | grep -c 'already configured') run(s) with no write and no restart"

# Kubelet restart -> re-registration, from the new kubelet.sock to the
# plugin's "registered" log line (both stamped by this machine's clock).
plugin_log() { ls -t "$node_dir"/root/var/log/pods/gpu-operator_nvidia-device-plugin-daemonset-*/nvidia-device-plugin/*.log | head -1; }
before=$(grep -c "registered with the kubelet" "$(plugin_log)" || true)
kill "$(cat "$state/pids/kubelet.pid")"
sleep 1
setsid sh "$node_dir/kubelet.sh" </dev/null >/dev/null 2>&1 &
echo $! >"$state/pids/kubelet.pid"
sock="$node_dir/root/var/lib/kubelet/device-plugins/kubelet.sock"
wait_until 60 "the new kubelet socket" test -S "$sock"
wait_until 60 "the plugin to register again" sh -c \
  "[ \$(grep -c 'registered with the kubelet' $(plugin_log)) -gt $before ]"
created=$(stat -c %.9Y "$sock")
registered=$(grep "registered with the kubelet" "$(plugin_log)" | tail -1 | awk '{print $1}')
registered=$(date -d "$registered" +%s.%N)
echo "figure: kubelet restart -> plugin registered: $(elapsed "$created" "$registered") s after kubelet.sock appeared"

echo "figure: RSS of the operands on the node (VmRSS / VmHWM, MiB):"
for dir in $(find /sys/fs/cgroup/memory/gpu-stack-29440 -name cgroup.procs -printf '%h\n' 2>/dev/null); do
  for pid in $(cat "$dir/cgroup.procs"); do
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null || true)
    case "$exe" in
      /usr/bin/gpu-*)
        awk -v exe="$exe" -v args="$(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -d' ' -f2)" \
          '/^VmRSS/ {rss=$2} /^VmHWM/ {hwm=$2} END {printf "  %-28s %-22s %6.1f / %6.1f\n", exe, args, rss/1024, hwm/1024}' \
          "/proc/$pid/status";;
    esac
  done
done | sort -u
