// Command etcd is etcd's own main, pinned by this module's go.mod, so the test
// harness does not depend on the distribution's (older) etcd package.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
