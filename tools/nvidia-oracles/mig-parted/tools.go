//go:build tools

// Wrapper module that pins NVIDIA's nvidia-mig-parted so build.sh can
// `go build` it from the module cache. The blank import keeps the command
// package and its dependencies in go.mod and go.sum; the tools build tag
// keeps this file out of every build.
package tools

import (
	_ "github.com/NVIDIA/mig-parted/cmd/nvidia-mig-parted"
)
