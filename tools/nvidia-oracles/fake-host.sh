#!/usr/bin/env bash
# Runs a command with the host files NVIDIA's tools read besides NVML, faked
# in a private mount namespace (run it under `unshare -m`, as root):
#   /proc/modules             lists the nvidia module (mig-parted uses NVML only then)
#   /sys/bus/pci/devices/ADDR NVIDIA 3D controllers (vendor, device, class,
#                             numa_node, resource): mig-parted enumerates them
#                             before looking each one up in NVML by bus id, the
#                             device plugin reads each GPU's NUMA node there
#   /proc/driver/nvidia-caps/mig-minors
#                             the MIG capability minors as the nvidia-caps
#                             module lists them (every GPU 0-31, GPU instance
#                             0-14, compute instance 0-7): the device plugin
#                             maps each MIG device to its /dev/nvidia-caps nodes
#   /proc/driver/nvidia/capabilities/mig/{config,monitor}
#                             the MIG capability files the driver creates
#   /dev/nvidia*              the driver's device nodes: nvidiactl, nvidia-uvm,
#                             nvidia-uvm-tools, nvidia<N> for the N-th GPU of
#                             the list (minor number N) and nvidia-caps/ with
#                             the MIG config and monitor nodes; no
#                             nvidia-modeset (not loaded on a headless node):
#                             the device plugins pass those that exist
#   /var/lib/kubelet/device-plugins
#                             with --kubelet-dir DIR, DIR bind-mounted there
#                             (the device plugin serves its sockets in that
#                             fixed directory)
# The rest of /proc, /proc/driver, /dev and /var/lib stays reachable through
# symlinks into the real ones.
#
# Usage: unshare -m tools/nvidia-oracles/fake-host.sh [--kubelet-dir DIR] \
#          ADDR=DEVICE[@NUMA][,ADDR=DEVICE[@NUMA]...] COMMAND [ARGS...]
#   e.g. 0000:07:00.0=0x20b0@0,0000:0f:00.0=0x20b0@1 nvidia-mig-parted export
# (NUMA defaults to 0.)
set -euo pipefail

kubelet_dir=""
if [[ "${1:-}" == "--kubelet-dir" ]]; then
	kubelet_dir="$(realpath "$2")"
	shift 2
fi
gpus="$1"
shift

# Replaces directory $1 (inside this namespace only) by a tmpfs holding
# symlinks to its real entries, kept mounted at stash directory $2 (an empty
# directory, reused by later runs).
shadow() {
	local dir="$1" stash="$2" e
	mkdir -p "$stash"
	mount --rbind "$dir" "$stash"
	mount -t tmpfs none "$dir"
	for e in "$stash"/* "$stash"/.[!.]*; do
		[[ -e "$e" || -L "$e" ]] || continue
		ln -s "$e" "$dir/$(basename "$e")"
	done
}

tmp="${TMPDIR:-/tmp}"
shadow /proc "$tmp/gpu-stack-fake-host-proc"
echo "nvidia 1 0 - Live 0x0000000000000000" >/proc/modules

# /proc/driver: a directory of its own, the real entries linked in.
real_driver="$(readlink /proc/driver || true)"
rm -f /proc/driver
mkdir -p /proc/driver
if [[ -n "$real_driver" && -d "$real_driver" ]]; then
	for e in "$real_driver"/*; do
		[[ -e "$e" ]] || continue
		ln -s "$e" "/proc/driver/$(basename "$e")"
	done
fi
mkdir -p /proc/driver/nvidia/capabilities/mig /proc/driver/nvidia-caps
printf 'DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n' \
	>/proc/driver/nvidia/capabilities/mig/config
printf 'DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n' \
	>/proc/driver/nvidia/capabilities/mig/monitor
# The nvidia-caps module's numbering: config 1, monitor 2, then per GPU 15
# GPU instances of 9 minors each (the GI's access, then its CIs 0-7).
awk 'BEGIN {
	print "config 1"; print "monitor 2"
	for (g = 0; g < 32; g++) for (i = 0; i < 15; i++) {
		m = 3 + g * 135 + i * 9
		printf "gpu%d/gi%d/access %d\n", g, i, m
		for (c = 0; c < 8; c++) printf "gpu%d/gi%d/ci%d/access %d\n", g, i, c, m + 1 + c
	}
}' >/proc/driver/nvidia-caps/mig-minors

# Character devices as the driver numbers them (major 195; nvidia-uvm and
# nvidia-caps get dynamic majors, 510 and 511 here).
shadow /dev "$tmp/gpu-stack-fake-host-dev"
node() {
	mknod -m 666 "$1" c "$2" "$3" 2>/dev/null || touch "$1"
}
node /dev/nvidiactl 195 255
node /dev/nvidia-uvm 510 0
node /dev/nvidia-uvm-tools 510 1
mkdir -p /dev/nvidia-caps
node /dev/nvidia-caps/nvidia-cap1 511 1
node /dev/nvidia-caps/nvidia-cap2 511 2
minor=0
for entry in ${gpus//,/ }; do
	node "/dev/nvidia$minor" 195 "$minor"
	minor=$((minor + 1))
done

mount -t tmpfs none /sys/bus/pci/devices
for entry in ${gpus//,/ }; do
	addr="${entry%%=*}"
	rest="${entry#*=}"
	device="${rest%%@*}"
	numa=0
	[[ "$rest" == *@* ]] && numa="${rest#*@}"
	d="/sys/bus/pci/devices/$addr"
	mkdir -p "$d"
	echo 0x10de >"$d/vendor"
	echo "$device" >"$d/device"
	echo 0x030200 >"$d/class"
	echo "$numa" >"$d/numa_node"
	echo "0x00000000b0000000 0x00000000b0ffffff 0x0000000000040200" >"$d/resource"
done

if [[ -n "$kubelet_dir" ]]; then
	# /var/lib/kubelet/device-plugins need not exist on this machine: shadow
	# the deepest existing parent and create the rest in its tmpfs.
	if [[ -d /var/lib/kubelet ]]; then
		shadow /var/lib/kubelet "$tmp/gpu-stack-fake-host-kubelet"
	else
		shadow /var/lib "$tmp/gpu-stack-fake-host-varlib"
		mkdir -p /var/lib/kubelet
	fi
	rm -f /var/lib/kubelet/device-plugins
	mkdir -p /var/lib/kubelet/device-plugins
	mount --bind "$kubelet_dir" /var/lib/kubelet/device-plugins
fi
exec "$@"
