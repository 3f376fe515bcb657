// Command notenrolled is the agent's CNI event server (agent/cniserver) in a
// process of its own, answering every pod "not enrolled", with the agent's
// pass list listing every pod so: the benchmark's stand-in for an agent,
// which on a node is a separate process from the runtime that execs the
// plugin.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/passlist"
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
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: notenrolled SOCKET PASS-LIST-DIR NAMESPACE/NAME UID")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	namespace, name, _ := strings.Cut(os.Args[3], "/")
	list, err := passlist.Open(os.Args[2], func(string, string) (string, bool, bool) { return os.Args[4], true, true }, slog.Default())
	if err == nil {
		err = list.Refresh(namespace, name)
	}
	if err == nil {
		go list.Run(ctx)
		var srv *cniserver.Server
		if srv, err = cniserver.New(cniserver.Config{SocketPath: os.Args[1], Handler: notEnrolled{}}); err == nil {
			err = srv.Serve(ctx)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
