#!/usr/bin/env bash
# Writes the wrapper module for one Kubernetes release into
# tools/control-plane/k8s/<major>.<minor>/ (go.mod, go.sum, the etcd main), from
# the release's own go.mod: k8s.io/kubernetes requires its staging modules at
# v0.0.0 and maps them to ./staging with replace lines that dependents ignore,
# so each one is replaced here with its published v0 version, and etcd is
# pinned at the version the release's own etcd client uses.
# Usage: tools/control-plane/k8s/new-version.sh v1.37.2
set -euo pipefail
version="${1:?usage: $0 v1.MINOR.PATCH (a k8s.io/kubernetes release the Go module proxy serves)}"
if ! [[ "$version" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]]; then
  echo "$0: '$version' is not a Kubernetes release tag like v1.37.2" >&2
  exit 2
fi
minor="${BASH_REMATCH[1]}"
patch="${BASH_REMATCH[2]}"
here="$(cd "$(dirname "$0")" && pwd)"
dir="$here/1.$minor"
mod="$(go mod download -json "k8s.io/kubernetes@$version" | awk -F'"' '$2 == "GoMod" {print $4}')"
if [ ! -f "$mod" ]; then
  echo "$0: could not fetch the go.mod of k8s.io/kubernetes@$version from the Go module proxy" >&2
  exit 1
fi
go_directive="$(awk '$1 == "go" {print $2; exit}' "$mod")"
etcd="$(awk '$1 == "go.etcd.io/etcd/client/v3" {print $2; exit}' "$mod")"
staging="$(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$mod" | sort -u)"
mkdir -p "$dir/cmd/etcd"
{
  echo "// Wrapper module that builds the Kubernetes $version control plane (kube-apiserver,"
  echo "// kube-controller-manager, kube-scheduler, kubectl), the test node's kubelet and"
  echo "// etcd $etcd from their published Go modules. Written by ../new-version.sh $version."
  echo "module gpu-stack.local/tools/control-plane/k8s/1.$minor"
  echo
  echo "go $go_directive"
  echo
  echo "require ("
  echo "	go.etcd.io/etcd/server/v3 $etcd"
  echo "	k8s.io/kubernetes $version"
  echo ")"
  echo
  echo "tool ("
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
    echo "	k8s.io/kubernetes/cmd/$cmd"
  done
  echo ")"
  echo
  echo "replace ("
  for m in $staging; do
    echo "	$m => $m v0.$minor.$patch"
  done
  echo ")"
} > "$dir/go.mod"
cat > "$dir/cmd/etcd/main.go" <<'GO'
// Command etcd runs the etcd server from the published go.etcd.io/etcd/server/v3
// module, at the version k8s.io/kubernetes selects for its own etcd client, so the
// test control plane needs no downloaded release binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
GO
(cd "$dir" && go mod tidy)
echo "wrote $dir (Kubernetes $version, etcd $etcd, go $go_directive)"
