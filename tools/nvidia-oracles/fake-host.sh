#!/usr/bin/env bash
# Runs a command with the host files nvidia-mig-parted reads besides NVML,
# faked in a private mount namespace (run it under `unshare -m`, as root):
#   /proc/modules             lists the nvidia module (mig-parted uses NVML only then)
#   /sys/bus/pci/devices/ADDR NVIDIA 3D controllers (vendor, device, class,
#                             numa_node, resource), which mig-parted enumerates
#                             before looking each one up in NVML by bus id
# The rest of /proc stays reachable through symlinks into the real one.
#
# Usage: unshare -m tools/nvidia-oracles/fake-host.sh ADDR=DEVICE[,ADDR=DEVICE...] COMMAND [ARGS...]
#   e.g. 0000:07:00.0=0x20b0,0000:0f:00.0=0x20b0 nvidia-mig-parted export
set -euo pipefail

gpus="$1"
shift
# Where the real /proc stays mounted (inside this namespace only; the empty
# directory is reused by later runs).
real="${TMPDIR:-/tmp}/gpu-stack-fake-host-proc"
mkdir -p "$real"
mount --rbind /proc "$real"
mount -t tmpfs none /proc
for e in "$real"/*; do
	ln -s "$e" "/proc/$(basename "$e")"
done
echo "nvidia 1 0 - Live 0x0000000000000000" >/proc/modules

mount -t tmpfs none /sys/bus/pci/devices
for pair in ${gpus//,/ }; do
	d="/sys/bus/pci/devices/${pair%%=*}"
	mkdir -p "$d"
	echo 0x10de >"$d/vendor"
	echo "${pair#*=}" >"$d/device"
	echo 0x030200 >"$d/class"
	echo 0 >"$d/numa_node"
	echo "0x00000000b0000000 0x00000000b0ffffff 0x0000000000040200" >"$d/resource"
done
exec "$@"
