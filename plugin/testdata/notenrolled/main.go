// Command notenrolled is the agent's CNI event server (agent/cniserver) in a
// process of its own, answering every pod "not enrolled": the benchmark's
// stand-in for an agent, which on a node is a separate process from the
// runtime that execs the plugin.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
)

type notEnrolled struct{}

func (notEnrolled) Add(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.NotEnrolled, nil
}
func (notEnrolled) Del(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.NotEnrolled, nil
}
func (notEnrolled) Check(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.NotEnrolled, nil
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: notenrolled SOCKET")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	srv, err := cniserver.New(cniserver.Config{SocketPath: os.Args[1], Handler: notEnrolled{}})
	if err == nil {
		err = srv.Serve(ctx)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
