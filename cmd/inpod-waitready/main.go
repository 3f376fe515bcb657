// Command inpod-waitready is inpod's init container (chart gate value
// initcontainer): it exits 0 once redirection to ztunnel is in place in its
// own network namespace, and non-zero with a message naming what is missing
// when it is not by the timeout. It needs no privilege. See package
// waitready for what the check proves and what it cannot.
//
// It takes its configuration from flags only, unlike inpod's other binaries
// (internal/envflag): it runs inside user pods, whose environment the
// kubelet fills with service links — a Service named inpod-probe would set
// INPOD_PROBE_PORT=tcp://10.96.0.7:80 in every container of its namespace.
// The admission policy passes every setting as an argument.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/inpod-dev/inpod/waitready"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	cfg, err := parse(args)
	if err == flag.ErrHelp {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.Progress = func(msg string) { fmt.Fprintln(os.Stderr, "waiting:", msg) }
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

// parse reads the flags, and nothing of the environment (see the package
// doc).
func parse(args []string) (waitready.Config, error) {
	fs := flag.NewFlagSet("inpod-waitready", flag.ContinueOnError)
	timeout := fs.Duration("timeout", waitready.DefaultTimeout, "give up (exit 1) when redirection is not in place after this long")
	probes := fs.String("probe", "", "comma list of ip:port ([ip]:port for IPv6) outside the pod to test outbound redirection with; empty: a fixed off-pod address per address family the pod has a default route in, at --probe-port")
	probePort := fs.Int("probe-port", waitready.DefaultProbePort, "the port of the default probes")
	dialTimeout := fs.Duration("dial-timeout", waitready.DefaultDialTimeout, "bound of one probe connection")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "inpod-waitready: waits until redirection to ztunnel is in place in this pod's network namespace (inpod's init container; unprivileged)\n\nUsage: inpod-waitready [flags]\n\nFlags only: the environment is the pod's (service links), never read.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return waitready.Config{}, err
	}
	if fs.NArg() > 0 {
		return waitready.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *probePort < 1 || *probePort > 65535 {
		// Config reads 0 as "the default": refuse it here, not silently.
		return waitready.Config{}, fmt.Errorf("--probe-port %d out of range 1-65535", *probePort)
	}
	cfg := waitready.Config{Timeout: *timeout, ProbePort: *probePort, DialTimeout: *dialTimeout}
	for p := range strings.SplitSeq(*probes, ",") {
		if p = strings.TrimSpace(p); p != "" {
			cfg.Probes = append(cfg.Probes, p)
		}
	}
	return cfg, nil
}
