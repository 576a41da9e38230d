#!/usr/bin/env bash
# Builds the helm command line from its Go module into a cache directory
# outside the checkout and prints the binary's path. A second run reuses the
# cached binary.
#   tools/helm/build.sh        Helm 4, pinned in tools/helm/go.mod
#   tools/helm/build.sh --v3   Helm 3, pinned in tools/helm/v3/go.mod (the
#                              chart is linted with both)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -gt 1 ]; then
  echo "tools/helm/build.sh: too many arguments; usage: tools/helm/build.sh [--v3]" >&2
  exit 1
fi
case "${1:-}" in
  "") major=4 dir="$here" ;;
  --v3) major=3 dir="$here/v3" ;;
  *)
    echo "tools/helm/build.sh: unknown argument '$1'; usage: tools/helm/build.sh [--v3]" >&2
    exit 1
    ;;
esac
module="helm.sh/helm/v$major"
version="$(awk -v m="$module" '$1 == "require" && $2 == m {print $3}' "$dir/go.mod")"
if [ -z "$version" ]; then
  echo "tools/helm/build.sh: no 'require $module <version>' line in $dir/go.mod" >&2
  exit 1
fi
# Like helm's Makefile: the Kubernetes version helm assumes for lint and
# template is one minor above its client-go (v0.N.x means Kubernetes 1.N).
k8s_minor="$(awk '$1 == "k8s.io/client-go" {split($2, v, "."); print v[2]}' "$dir/go.mod")"
if [ -z "$k8s_minor" ]; then
  echo "tools/helm/build.sh: no k8s.io/client-go line in $dir/go.mod; run 'go mod tidy' there" >&2
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
  ldflags="-s -w -X $module/internal/version.version=$version"
  # Helm 3 takes that Kubernetes version from these variables. Helm 4 has
  # none: it reads client-go's version from the binary's module information.
  if [ "$major" = 3 ]; then
    for pkg in "$module/pkg/lint/rules" "$module/pkg/chartutil"; do
      ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
    done
  fi
  (cd "$dir" && CGO_ENABLED=0 nice go build -trimpath -ldflags "$ldflags" \
    -o "$out.tmp" "$module/cmd/helm")
  mv "$out.tmp" "$out"
fi
echo "$out"
