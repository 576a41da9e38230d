//go:build tools

// Package tools pins containerd 1.7 for the real test node (a matrix entry:
// many nodes still run it): containerd 1.6
// (Debian's) silently ignores the CRI CDI devices field. The binaries are
// built with `go build` from this module (see xtask/src/gobuild.rs).
package tools

import (
	_ "github.com/containerd/containerd/cmd/containerd"
	_ "github.com/containerd/containerd/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/cmd/ctr"
)
