// Command inpod-probe is the agent container's exec probe: it asks the
// agent in its own container over the probe socket (inpod-agent
// --probe-socket) and exits 0 when the answer is 200, 1 otherwise, printing
// the agent's answer. The agent runs with hostNetwork: an httpGet probe of
// its port would reach whichever agent holds the node's port, and during a
// rollout's surge two agents run on a node. It uses only the standard
// library, so the kubelet's every probe costs a millisecond, not the agent
// binary's start.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("inpod-probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for the agent's answer")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: inpod-probe [--timeout D] SOCKET PATH\n\nAsks the agent serving SOCKET for PATH (/healthz or /readyz); exits 0 on 200.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() != 2 || !strings.HasPrefix(fs.Arg(1), "/") {
		fs.Usage()
		return 2
	}
	socket, path := fs.Arg(0), fs.Arg(1)
	client := &http.Client{Timeout: *timeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
	}}
	resp, err := client.Get("http://agent" + path)
	if err != nil {
		fmt.Fprintf(stderr, "inpod-probe: %s%s: %v\n", socket, path, err)
		return 1
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(stderr, "inpod-probe: %s%s: %s: %s", socket, path, resp.Status, body)
		return 1
	}
	stdout.Write(body)
	return 0
}
