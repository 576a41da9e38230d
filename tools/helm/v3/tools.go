//go:build tools

// Package tools pins the Helm 3 command line so `go build` can produce it
// from the module proxy; gpu-stack lints deploy/helm/gpu-stack with it too,
// as users still install charts with Helm 3.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
