#!/usr/bin/env bash
# Figures for gpu-exporter on a simulated node of 8 A100 GPUs x 7 MIG instances
# (56 entities) with pod attribution on (a stand-in kubelet assigns every MIG
# device to a pod):
#   - time from process start to the first complete scrape
#   - scrape latency p50/p99, end to end (curl) and server side (the exporter's
#     own gpu_exporter_scrape_duration_seconds histogram)
#   - bytes per scrape, CPU per scrape, steady-state RSS
# Everything listens on 127.0.0.1 or a unix socket in a temp dir; every loop is
# bounded. Usage: scripts/bench-exporter.sh [SCRAPES]   (default 2000;
# SKIP_BUILD=1 uses the release binaries already built; FIELDS=all runs 8 H100s
# x 7 instances with every DCGM field of dcgm-exporter's full counters file on,
# GPM profiling included)
set -euo pipefail
cd "$(dirname "$0")/.."

SCRAPES="${1:-2000}"
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release -q -p gpu-stack-bins --bin gpu-exporter
  cargo build --release -q -p gpu-stack-k8s --example podresources_standin
fi
EXPORTER="$TARGET_DIR/release/gpu-exporter"
STANDIN="$TARGET_DIR/release/examples/podresources_standin"

WORK="$(mktemp -d)"
EXP_PID=""
STANDIN_PID=""
cleanup() {
  [ -n "$EXP_PID" ] && kill "$EXP_PID" 2>/dev/null || true
  [ -n "$STANDIN_PID" ] && kill -INT "$STANDIN_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

COUNTERS_ARGS=()
if [ "${FIELDS:-}" = all ]; then
  MODEL=H100-SXM5-80GB; SLICE=1g.10gb
  COUNTERS_ARGS=(-f gpu-stack-core/tests/data/metrics/dcgm-exporter-all-fields.csv)
else
  MODEL=A100-SXM4-40GB; SLICE=1g.5gb
fi
cat > "$WORK/fleet.yaml" <<YAML
nodes:
  - name: bench-node
    gpus:
      - model: $MODEL
        count: 8
        mig:
          enabled: true
          instances: ["$SLICE@0", "$SLICE@1", "$SLICE@2", "$SLICE@3", "$SLICE@4", "$SLICE@5", "$SLICE@6"]
YAML

SOCK="$WORK/kubelet.sock"
"$STANDIN" "$SOCK" "$WORK/fleet.yaml" 2>/dev/null &
STANDIN_PID=$!
for _ in $(seq 1 500); do [ -S "$SOCK" ] && break; sleep 0.01; done
[ -S "$SOCK" ] || { echo "stand-in kubelet did not start" >&2; exit 1; }

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
URL="http://127.0.0.1:$PORT/metrics"
EXPECTED=56

START_NS=$(date +%s%N)
"$EXPORTER" --backend simulated --fleet "$WORK/fleet.yaml" --listen "127.0.0.1:$PORT" \
  --pod-resources-socket "$SOCK" --pod-resources-refresh-ms 100 \
  --collect-interval 60000 --hostname bench-node "${COUNTERS_ARGS[@]}" 2>"$WORK/exporter.log" &
EXP_PID=$!
FIRST_NS=""
for _ in $(seq 1 5000); do
  if body=$(curl -sf "$URL" 2>/dev/null) \
     && [ "$(grep -c '^DCGM_FI_DEV_GPU_TEMP{.*pod="' <<<"$body")" -eq "$EXPECTED" ]; then
    FIRST_NS=$(date +%s%N)
    break
  fi
  sleep 0.002
done
[ -n "$FIRST_NS" ] || { echo "no complete scrape within the bound" >&2; cat "$WORK/exporter.log" >&2; exit 1; }
START_MS=$(( (FIRST_NS - START_NS) / 1000000 ))

BYTES=$(curl -s "$URL" | wc -c)
FAMILIES=$(curl -s "$URL" | grep -c '^# TYPE DCGM_')

ticks() { awk '{print $14 + $15}' "/proc/$EXP_PID/stat"; }
CLK=$(getconf CLK_TCK)
T0=$(ticks)
# One curl process for all scrapes (keep-alive), timing each transfer.
args=()
for _ in $(seq 1 "$SCRAPES"); do args+=(-o /dev/null "$URL"); done
curl -s -w '%{time_total}\n' "${args[@]}" > "$WORK/e2e.txt"
T1=$(ticks)
RSS_KB=$(awk '/^VmRSS/ {print $2}' "/proc/$EXP_PID/status")
HWM_KB=$(awk '/^VmHWM/ {print $2}' "/proc/$EXP_PID/status")
curl -s "$URL" > "$WORK/last.prom"

python3 - "$WORK/e2e.txt" "$WORK/last.prom" "$SCRAPES" "$T0" "$T1" "$CLK" "$START_MS" "$BYTES" "$FAMILIES" "$RSS_KB" "$HWM_KB" <<'PY'
import sys, re
e2e_path, prom_path, n, t0, t1, clk, start_ms, bytes_, families, rss, hwm = sys.argv[1:]
e2e = sorted(float(x) for x in open(e2e_path) if x.strip())
q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]
buckets = []
count = 0
for line in open(prom_path):
    m = re.match(r'gpu_exporter_scrape_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
    if m:
        le = float('inf') if m.group(1) == '+Inf' else float(m.group(1))
        buckets.append((le, float(m.group(2))))
    m = re.match(r'gpu_exporter_scrape_duration_seconds_count (\S+)', line)
    if m:
        count = float(m.group(1))
def hq(p):
    # histogram_quantile-style linear interpolation within the bucket
    rank = p * count
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float('inf'):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return float('nan')
cpu_s = (int(t1) - int(t0)) / int(clk)
series = sum(1 for l in open(prom_path) if l.startswith('DCGM_'))
print(f"entities: 8 GPUs x 7 MIG instances = 56, attribution on; {families} DCGM families, {series} DCGM series")
print(f"time to first complete scrape: {start_ms} ms")
print(f"scrape latency end to end (curl, {len(e2e)} scrapes): p50 {q(e2e,0.50)*1000:.3f} ms, p99 {q(e2e,0.99)*1000:.3f} ms")
print(f"scrape latency server side (histogram, {int(count)} scrapes): p50 {hq(0.50)*1000:.3f} ms, p99 {hq(0.99)*1000:.3f} ms")
print(f"bytes per scrape: {bytes_} (Prometheus text)")
print(f"CPU per scrape: {cpu_s / int(n) * 1e6:.1f} us ({cpu_s:.2f} s CPU for {n} scrapes, clock tick {1/int(clk)*1000:.0f} ms)")
print(f"RSS at steady state: {int(rss)/1024:.1f} MiB (peak {int(hwm)/1024:.1f} MiB)")
PY
