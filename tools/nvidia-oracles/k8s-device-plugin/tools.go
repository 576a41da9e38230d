//go:build tools

// Wrapper module that pins NVIDIA's device plugin and gpu-feature-discovery
// (both commands of github.com/NVIDIA/k8s-device-plugin) so build.sh can
// `go build` them from the module cache. The blank imports keep the command
// packages and their dependencies in go.mod and go.sum; the tools build tag
// keeps this file out of every build.
package tools

import (
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/gpu-feature-discovery"
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
)
