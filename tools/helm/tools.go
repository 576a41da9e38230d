//go:build tools

// Package tools pins the Helm 4 command line so `go build` can produce it
// from the module proxy; gpu-stack uses it to lint and render
// deploy/helm/gpu-stack and to install it in the real-node test. Helm 3 is
// pinned in v3/.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
