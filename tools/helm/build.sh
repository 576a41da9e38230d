#!/usr/bin/env bash
# Builds the helm command line from its Go module (pinned in go.mod) into a
# cache directory outside the checkout and prints the binary's path. A second
# run reuses the cached binary. Usage: tools/helm/build.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="$(awk '$1 == "require" && $2 == "helm.sh/helm/v3" {print $3}' "$here/go.mod")"
if [ -z "$version" ]; then
  echo "tools/helm/build.sh: no 'require helm.sh/helm/v3 <version>' line in $here/go.mod" >&2
  exit 1
fi
# Like helm's Makefile: the Kubernetes version helm assumes for lint and
# template is one minor above its client-go (v0.N.x means Kubernetes 1.N).
k8s_minor="$(awk '$1 == "k8s.io/client-go" {split($2, v, "."); print v[2]}' "$here/go.mod")"
if [ -z "$k8s_minor" ]; then
  echo "tools/helm/build.sh: no k8s.io/client-go line in $here/go.mod; run 'go mod tidy' there" >&2
  exit 1
fi
cache="${GPU_STACK_TOOLS_CACHE:-$HOME/.cache/gpu-stack/tools}"
out="$cache/helm-$version-k8s1.$k8s_minor/helm"
if [ ! -x "$out" ]; then
  if ! command -v go >/dev/null 2>&1; then
    echo "tools/helm/build.sh: 'go' is not on PATH; install Go 1.26 or newer to build helm $version" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$out")"
  echo "building helm $version into $out (first run only)" >&2
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  (cd "$here" && CGO_ENABLED=0 nice go build -trimpath -ldflags "$ldflags" \
    -o "$out.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$out.tmp" "$out"
fi
echo "$out"
