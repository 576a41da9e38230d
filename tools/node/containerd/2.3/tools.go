//go:build tools

// Package tools pins containerd 2.3 for the real test node. The binaries are
// built with `go build` from this module (see xtask/src/gobuild.rs).
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
