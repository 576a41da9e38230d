#!/usr/bin/env bash
# Builds NVIDIA's own NVML clients from their published Go modules, to run as
# oracles against the stand-in libnvidia-ml (nvml-standin):
#   gpu-feature-discovery, nvidia-device-plugin  (github.com/NVIDIA/k8s-device-plugin)
#   nvidia-mig-parted                            (github.com/NVIDIA/mig-parted)
# Each comes from a wrapper module here (go.mod pins the version, tools.go
# keeps the command package in go.sum); the binaries land in
#   ${GPU_STACK_NVIDIA_ORACLES_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-stack/nvidia-oracles}/bin
# and a stamp of the inputs (module files, this script, the Go version) makes a
# second run a no-op. go-nvml uses cgo (it dlopens libnvidia-ml.so.1 through
# libdl), so a C compiler is needed; no NVIDIA driver or header is.
#
# Usage: tools/nvidia-oracles/build.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${GPU_STACK_NVIDIA_ORACLES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-stack/nvidia-oracles}"
bin="$cache/bin"
stamp_file="$bin/.build-stamp"

# module directory, then the binaries it builds as name=package.
modules=(
	"k8s-device-plugin gpu-feature-discovery=github.com/NVIDIA/k8s-device-plugin/cmd/gpu-feature-discovery nvidia-device-plugin=github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
	"mig-parted nvidia-mig-parted=github.com/NVIDIA/mig-parted/cmd/nvidia-mig-parted"
)

find_go() {
	if [[ -n "${GO:-}" ]]; then
		[[ -x "$GO" ]] || {
			echo "GO=$GO is not an executable; point it at a Go 1.25+ toolchain or unset it" >&2
			exit 1
		}
		echo "$GO"
	elif command -v go >/dev/null 2>&1; then
		command -v go
	elif [[ -x /usr/local/go/bin/go ]]; then
		echo /usr/local/go/bin/go
	else
		echo "the Go toolchain was not found (looked at \$GO, PATH and /usr/local/go/bin/go);" \
			"install Go 1.25 or newer, or set GO=/path/to/go" >&2
		exit 1
	fi
}

go="$(find_go)"
command -v "${CC:-cc}" >/dev/null 2>&1 || {
	echo "no C compiler (${CC:-cc}): go-nvml needs cgo; install gcc or set CC" >&2
	exit 1
}

stamp="$(
	{
		"$go" version
		cat "$here/build.sh"
		for m in "${modules[@]}"; do
			dir="${m%% *}"
			echo "$m"
			cat "$here/$dir/go.mod" "$here/$dir/go.sum" "$here/$dir/tools.go"
		done
	} | sha256sum | cut -d' ' -f1
)"

names=()
for m in "${modules[@]}"; do
	for pair in ${m#* }; do
		names+=("${pair%%=*}")
	done
done

up_to_date() {
	[[ "$(cat "$stamp_file" 2>/dev/null)" == "$stamp" ]] || return 1
	for n in "${names[@]}"; do
		[[ -x "$bin/$n" ]] || return 1
	done
}

if [[ "${1:-}" != "--force" ]] && up_to_date; then
	echo "NVIDIA oracle binaries are up to date in $bin"
	exit 0
fi

mkdir -p "$bin"
rm -f "$stamp_file"
start=$SECONDS
for m in "${modules[@]}"; do
	dir="${m%% *}"
	pkgs=()
	for pair in ${m#* }; do
		pkgs+=("${pair#*=}")
	done
	echo "building ${pkgs[*]} ($("$go" version | cut -d' ' -f3))" >&2
	(
		cd "$here/$dir"
		CGO_ENABLED=1 GOFLAGS="${GOFLAGS:-} -mod=readonly" \
			"$go" build -trimpath -ldflags "-s -w" -o "$bin/" "${pkgs[@]}"
	)
done
echo "$stamp" >"$stamp_file"
echo "built ${names[*]} into $bin in $((SECONDS - start))s"
