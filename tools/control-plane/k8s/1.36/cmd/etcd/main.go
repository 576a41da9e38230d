// Command etcd runs the etcd server from the published go.etcd.io/etcd/server/v3
// module, at the version k8s.io/kubernetes selects for its own etcd client, so the
// test control plane needs no downloaded release binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
