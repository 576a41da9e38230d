//go:build tools

// Package tools pins the helm command line so `go build` can produce it from
// the module proxy; gpu-stack uses it to lint and render deploy/helm/gpu-stack.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
