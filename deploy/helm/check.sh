#!/usr/bin/env bash
# Lints and renders the gpu-stack chart with Helm 4 built from its Go module
# (tools/helm), and lints it with Helm 3 too (tools/helm/v3). Fails if the
# chart's CRDs differ from the generated ones in deploy/crds/ (ClusterPolicy,
# NVIDIADriver) or are not installed, if lint finds a problem, if a rendering
# misses an object, or if the Kubernetes versions the chart admits
# (kubeVersion) are not 1.34 and later.
# Usage: deploy/helm/check.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
chart="$root/deploy/helm/gpu-stack"
helm="$("$root/tools/helm/build.sh")"
helm3="$("$root/tools/helm/build.sh" --v3)"

# The chart ships the CRDs generated from the Rust types; keep them identical.
for crd in "$root"/deploy/crds/*.yaml; do
  [ -e "$crd" ] || continue
  copy="$chart/crds/$(basename "$crd")"
  if ! cmp -s "$crd" "$copy"; then
    echo "deploy/helm/check.sh: $copy differs from $crd; run: cp $crd $copy" >&2
    exit 1
  fi
done

# No registry publishes the images: every rendering names one.
repo=(--set imageRepository=registry.example.com/gpu-stack)
nice "$helm" lint --strict "$chart" "${repo[@]}"
# Helm 3 is still what many clusters are managed with.
nice "$helm3" lint --strict "$chart" "${repo[@]}"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# Helm 4 ends each rendered document with a blank line, Helm 3 does not: the
# plain files are compared without it.
drop_trailing_blank_lines() { awk '{ line[NR] = $0 } NF { last = NR } END { for (i = 1; i <= last; i++) print line[i] }'; }

# kubeVersion: Kubernetes 1.34 and later render, 1.33 is refused, naming the
# constraint. (--kube-version drops a vendor suffix such as -gke.1200, so the
# "-0" that admits one from a live cluster is not exercised here.)
for h in "$helm" "$helm3"; do
  for v in v1.34.0 v1.35.0 v1.37.0; do
    if ! nice "$h" template gpu-stack "$chart" "${repo[@]}" --kube-version "$v" >/dev/null 2>"$out/kube.err"; then
      echo "deploy/helm/check.sh: helm $("$h" version --short) does not render the chart for Kubernetes $v; check kubeVersion in $chart/Chart.yaml: $(cat "$out/kube.err")" >&2
      exit 1
    fi
  done
  if nice "$h" template gpu-stack "$chart" "${repo[@]}" --kube-version v1.33.9 >/dev/null 2>"$out/kube.err"; then
    echo "deploy/helm/check.sh: helm $("$h" version --short) renders the chart for Kubernetes 1.33; kubeVersion in $chart/Chart.yaml must start at 1.34" >&2
    exit 1
  fi
  grep -q 'chart requires kubeVersion' "$out/kube.err" \
    || { echo "deploy/helm/check.sh: helm $("$h" version --short) refuses Kubernetes 1.33 without naming kubeVersion: $(cat "$out/kube.err")" >&2; exit 1; }
done

# Without imageRepository the chart refuses to render, saying what to set.
if nice "$helm" template gpu-stack "$chart" >"$out/norepo.yaml" 2>"$out/norepo.err"; then
  echo "deploy/helm/check.sh: the chart renders without imageRepository" >&2
  exit 1
fi
grep -q 'imageRepository is not set' "$out/norepo.err" \
  || { echo "deploy/helm/check.sh: a missing imageRepository is not named: $(cat "$out/norepo.err")" >&2; exit 1; }
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator --include-crds "${repo[@]}" >"$out/default.yaml"
grep -q 'image: registry.example.com/gpu-stack/gpu-operator:' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: the operator image is not from imageRepository" >&2; exit 1; }
grep -A3 '^  devicePlugin:$' "$out/default.yaml" | grep -q 'repository: registry.example.com/gpu-stack' \
  || { echo "deploy/helm/check.sh: the device plugin image is not from imageRepository" >&2; exit 1; }
# Every generated CRD (ClusterPolicy, NVIDIADriver) is installed by the chart.
for crd in "$root"/deploy/crds/*.yaml; do
  [ -e "$crd" ] || continue
  name="$(sed -n 's/^  name: //p' "$crd" | head -1)"
  grep -q "^  name: $name\$" "$out/default.yaml" \
    || { echo "deploy/helm/check.sh: the chart does not install the CRD $name ($(basename "$crd"))" >&2; exit 1; }
done
kinds="ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding Deployment Service ClusterPolicy"
if compgen -G "$chart/crds/*.yaml" >/dev/null; then kinds="CustomResourceDefinition $kinds"; fi
for kind in $kinds; do
  if ! grep -q "^kind: $kind\$" "$out/default.yaml"; then
    echo "deploy/helm/check.sh: default rendering has no $kind" >&2
    exit 1
  fi
done
grep -q '^  replicas: 2$' "$out/default.yaml" || { echo "deploy/helm/check.sh: operator is not 2 replicas" >&2; exit 1; }
# CRDs: applied before install and every upgrade by default (NVIDIA's
# upgradeCRD); deleted after uninstall only with cleanupCRD.
grep -q -- '- --apply-crds$' "$out/default.yaml" && grep -q 'helm.sh/hook: pre-install,pre-upgrade' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: the default rendering has no CRD upgrade hook" >&2; exit 1; }
! grep -q -- '--delete-crds' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: CRDs are deleted at uninstall by default" >&2; exit 1; }
"$helm" template gpu-stack "$chart" "${repo[@]}" --set operator.cleanupCRD=true --set operator.upgradeCRD=false >"$out/crds.yaml"
grep -q -- '- --delete-crds$' "$out/crds.yaml" && grep -q 'helm.sh/hook: post-delete' "$out/crds.yaml" && ! grep -q -- '--apply-crds' "$out/crds.yaml" \
  || { echo "deploy/helm/check.sh: operator.cleanupCRD/upgradeCRD are not honoured" >&2; exit 1; }

# Knobs: no default ClusterPolicy, a component disabled, an image override.
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set clusterPolicy.deployCR=false >"$out/nocr.yaml"
if grep -q '^kind: ClusterPolicy$' "$out/nocr.yaml"; then
  echo "deploy/helm/check.sh: clusterPolicy.deployCR=false still renders a ClusterPolicy" >&2
  exit 1
fi
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set dcgmExporter.enabled=false --set devicePlugin.version=v9.9.9 >"$out/knobs.yaml"
grep -A1 '^  dcgmExporter:$' "$out/knobs.yaml" | grep -q 'enabled: false' \
  || { echo "deploy/helm/check.sh: dcgmExporter.enabled=false not passed to the ClusterPolicy" >&2; exit 1; }
grep -q 'version: v9.9.9' "$out/knobs.yaml" \
  || { echo "deploy/helm/check.sh: devicePlugin.version not passed to the ClusterPolicy" >&2; exit 1; }
# NVIDIA's sections without a gpu-stack operand reach the ClusterPolicy, for
# the operator to honour (sandboxWorkloads) or report.
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set sandboxWorkloads.enabled=true --set sandboxWorkloads.defaultWorkload=vm-passthrough \
  --set vfioManager.enabled=true --set gdrcopy.enabled=true >"$out/sandbox.yaml"
grep -A3 '^  sandboxWorkloads:$' "$out/sandbox.yaml" | grep -q 'defaultWorkload: vm-passthrough' \
  || { echo "deploy/helm/check.sh: sandboxWorkloads not passed to the ClusterPolicy" >&2; exit 1; }
for section in vfioManager gdrcopy; do
  grep -A1 "^  $section:\$" "$out/sandbox.yaml" | grep -q 'enabled: true' \
    || { echo "deploy/helm/check.sh: $section not passed to the ClusterPolicy" >&2; exit 1; }
done
# toolkit.image=gpu-stack: gpu-stack's toolkit agent, from imageRepository;
# NVIDIA's toolkit stays the default.
grep -A4 '^  toolkit:$' "$out/default.yaml" | grep -q 'repository: nvcr.io/nvidia/k8s' \
  || { echo "deploy/helm/check.sh: NVIDIA's toolkit is not the default" >&2; exit 1; }
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set toolkit.image=gpu-stack --set toolkit.repository= --set toolkit.version= >"$out/toolkit.yaml"
grep -A6 '^  toolkit:$' "$out/toolkit.yaml" | grep -q 'repository: registry.example.com/gpu-stack' \
  || { echo "deploy/helm/check.sh: toolkit.image=gpu-stack does not take imageRepository" >&2; exit 1; }
# draDriver (the DRA kubelet plugin): off by default; on, it takes its image
# from imageRepository and the DeviceClasses' driver name, and the operator
# may grant its role.
sed -n '/^  draDriver:$/,/^  [a-zA-Z]/p' "$out/default.yaml" | grep -q '^    enabled: false$' \
  || { echo "deploy/helm/check.sh: draDriver is not off by default" >&2; exit 1; }
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set draDriver.enabled=true --set dra.driverName=gpu.example.com >"$out/dra.yaml"
dra_section="$(sed -n '/^  draDriver:$/,/^  [a-zA-Z]/p' "$out/dra.yaml")"
for want in 'enabled: true' 'repository: registry.example.com/gpu-stack' 'driverName: gpu.example.com'; do
  grep -q "^    $want\$" <<<"$dra_section" \
    || { echo "deploy/helm/check.sh: draDriver.enabled=true renders no \"$want\" in the ClusterPolicy: $dra_section" >&2; exit 1; }
done
# ...and NVIDIA's DeviceClasses, selecting the devices of that driver name;
# none by default.
for class in gpu.nvidia.com mig.nvidia.com; do
  grep -A12 "^  name: $class\$" "$out/dra.yaml" | grep -q "device.driver == 'gpu.example.com'" \
    || { echo "deploy/helm/check.sh: draDriver.enabled=true renders no DeviceClass $class for gpu.example.com" >&2; exit 1; }
done
! grep -q '^kind: DeviceClass$' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: DeviceClasses are installed by default" >&2; exit 1; }
grep -q '"nvidia-dra-driver-gpu-kubelet-plugin"' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: the operator may not grant the DRA plugin's ClusterRole (operandRoles)" >&2; exit 1; }
# nodeAgent (one DaemonSet for the node agents): off by default; on, it
# takes its image from imageRepository, and the operator may grant its role.
sed -n '/^  nodeAgent:$/,/^  [a-zA-Z]/p' "$out/default.yaml" | grep -q '^    enabled: false$' \
  || { echo "deploy/helm/check.sh: nodeAgent is not off by default" >&2; exit 1; }
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" \
  --set nodeAgent.enabled=true >"$out/agent.yaml"
agent_section="$(sed -n '/^  nodeAgent:$/,/^  [a-zA-Z]/p' "$out/agent.yaml")"
for want in 'enabled: true' 'repository: registry.example.com/gpu-stack'; do
  grep -q "^    $want\$" <<<"$agent_section" \
    || { echo "deploy/helm/check.sh: nodeAgent.enabled=true renders no \"$want\" in the ClusterPolicy: $agent_section" >&2; exit 1; }
done
grep -q '"gpu-stack-node-agent"' "$out/default.yaml" \
  || { echo "deploy/helm/check.sh: the operator may not grant the node agent's ClusterRole (operandRoles)" >&2; exit 1; }

# Alerts and dashboard (docs/exporter.md, "Alerts and dashboard"): the chart's copies in
# files/ are the plain files in deploy/monitoring/, byte for byte; both are off
# by default and render when enabled.
for f in gpu-stack-alerts.rules.yaml gpu-stack-dashboard.json; do
  if ! cmp -s "$chart/files/$f" "$root/deploy/monitoring/$f"; then
    echo "deploy/helm/check.sh: deploy/monitoring/$f differs from $chart/files/$f; run: cp $chart/files/$f $root/deploy/monitoring/$f" >&2
    exit 1
  fi
done
if grep -q '^kind: PrometheusRule$' "$out/default.yaml"; then
  echo "deploy/helm/check.sh: the default rendering has a PrometheusRule (dcgmExporter.prometheusRule.enabled is false)" >&2
  exit 1
fi
if grep -q 'grafana_dashboard' "$out/default.yaml"; then
  echo "deploy/helm/check.sh: the default rendering has the dashboard ConfigMap (dcgmExporter.grafanaDashboard.enabled is false)" >&2
  exit 1
fi
monitoring=(--set dcgmExporter.prometheusRule.enabled=true --set dcgmExporter.grafanaDashboard.enabled=true)
nice "$helm" lint --strict "$chart" "${repo[@]}" "${monitoring[@]}"
nice "$helm3" lint --strict "$chart" "${repo[@]}" "${monitoring[@]}"
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" "${monitoring[@]}" \
  --set dcgmExporter.prometheusRule.labels.release=kube-prometheus-stack >"$out/monitoring.yaml"
for kind in PrometheusRule ConfigMap ClusterPolicy; do
  if [ "$(grep -c "^kind: $kind\$" "$out/monitoring.yaml")" != 1 ]; then
    echo "deploy/helm/check.sh: with the alerts and dashboard enabled there is not exactly one $kind" >&2
    exit 1
  fi
done
grep -q '^apiVersion: monitoring.coreos.com/v1$' "$out/monitoring.yaml" \
  || { echo "deploy/helm/check.sh: the PrometheusRule is not monitoring.coreos.com/v1" >&2; exit 1; }
grep -q '^    release: kube-prometheus-stack$' "$out/monitoring.yaml" \
  || { echo "deploy/helm/check.sh: dcgmExporter.prometheusRule.labels are not on the PrometheusRule" >&2; exit 1; }
grep -q '^    grafana_dashboard: "1"$' "$out/monitoring.yaml" \
  || { echo "deploy/helm/check.sh: the dashboard ConfigMap lacks the grafana_dashboard: \"1\" sidecar label" >&2; exit 1; }
# The chart's own keys stay out of the ClusterPolicy's dcgmExporter section.
if grep -Eq '^    (prometheusRule|grafanaDashboard):' "$out/monitoring.yaml"; then
  echo "deploy/helm/check.sh: dcgmExporter.prometheusRule or .grafanaDashboard reached the ClusterPolicy" >&2
  exit 1
fi
# The rendered rule groups (spec) and dashboard (data) are the plain files.
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" "${monitoring[@]}" \
  --show-only templates/prometheusrule.yaml | sed -n '/^spec:$/,$p' | tail -n +2 | sed 's/^  //' \
  | drop_trailing_blank_lines >"$out/rules.yaml"
if ! cmp -s "$out/rules.yaml" "$root/deploy/monitoring/gpu-stack-alerts.rules.yaml"; then
  echo "deploy/helm/check.sh: the PrometheusRule's groups differ from deploy/monitoring/gpu-stack-alerts.rules.yaml:" >&2
  diff "$root/deploy/monitoring/gpu-stack-alerts.rules.yaml" "$out/rules.yaml" | head -20 >&2
  exit 1
fi
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" "${monitoring[@]}" \
  --show-only templates/grafana-dashboard.yaml | sed -n '/^  gpu-stack-dashboard.json: |-$/,$p' | tail -n +2 | sed 's/^    //' \
  | drop_trailing_blank_lines >"$out/dashboard.json"
if ! cmp -s "$out/dashboard.json" "$root/deploy/monitoring/gpu-stack-dashboard.json"; then
  echo "deploy/helm/check.sh: the dashboard ConfigMap's JSON differs from deploy/monitoring/gpu-stack-dashboard.json:" >&2
  diff "$root/deploy/monitoring/gpu-stack-dashboard.json" "$out/dashboard.json" | head -20 >&2
  exit 1
fi
# jobRegex sets the exporter's job matcher, and only that.
nice "$helm" template gpu-stack "$chart" --namespace gpu-operator "${repo[@]}" "${monitoring[@]}" \
  --set dcgmExporter.prometheusRule.jobRegex=gpu-nodes --show-only templates/prometheusrule.yaml >"$out/job.yaml"
if [ "$(grep -c 'up{job=~"gpu-nodes"}' "$out/job.yaml")" != 3 ] || grep -q 'gpu-exporter\.\*"' "$out/job.yaml"; then
  echo "deploy/helm/check.sh: dcgmExporter.prometheusRule.jobRegex does not replace the job matcher of the exporter alerts" >&2
  exit 1
fi
echo "helm chart: lint and template OK (helm $("$helm" version --short); lint with helm $("$helm3" version --short) too)"
