// Command inpod-waitready is inpod's init container (chart gate value
// initcontainer): it exits 0 once redirection to ztunnel is in place in its
// own network namespace, and non-zero with a message naming what is missing
// when it is not by the timeout. It needs no privilege. See package
// waitready for what the check proves and what it cannot.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/waitready"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("inpod-waitready", flag.ContinueOnError)
	timeout := fs.Duration("timeout", waitready.DefaultTimeout, "give up (exit 1) when redirection is not in place after this long")
	probes := fs.String("probe", "", "comma list of ip:port ([ip]:port for IPv6) outside the pod to test outbound redirection with; empty: each default gateway of the pod at --probe-port")
	probePort := fs.Int("probe-port", waitready.DefaultProbePort, "the port probed on the default gateways")
	dialTimeout := fs.Duration("dial-timeout", waitready.DefaultDialTimeout, "bound of one probe connection")
	err := envflag.Parse(fs, "inpod-waitready: waits until redirection to ztunnel is in place in this pod's network namespace (inpod's init container; unprivileged)", args)
	if err == flag.ErrHelp {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if *probePort < 1 || *probePort > 65535 {
		// Config reads 0 as "the default": refuse it here, not silently.
		fmt.Fprintf(os.Stderr, "--probe-port %d out of range 1-65535\n", *probePort)
		return 2
	}
	cfg := waitready.Config{
		Timeout: *timeout, ProbePort: *probePort, DialTimeout: *dialTimeout,
		Progress: func(msg string) { fmt.Fprintln(os.Stderr, "waiting:", msg) },
	}
	for p := range strings.SplitSeq(*probes, ",") {
		if p = strings.TrimSpace(p); p != "" {
			cfg.Probes = append(cfg.Probes, p)
		}
	}
	check, err := waitready.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	proof, err := check.Run(ctx)
	if err != nil {
		// The last line is the pod's termination message
		// (terminationMessagePolicy FallbackToLogsOnError).
		fmt.Fprintln(os.Stderr, "inpod-waitready:", err)
		return 1
	}
	fmt.Println(proof)
	return 0
}
