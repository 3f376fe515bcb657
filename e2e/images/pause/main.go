// Command pause is the sandbox ("pause") container's process for the test
// node: it holds the pod's namespaces open until it is told to stop, and
// reaps nothing else.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
}
