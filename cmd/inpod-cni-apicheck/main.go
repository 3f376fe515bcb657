// Command inpod-cni-apicheck decides from the API server whether a pod is
// enrolled in the mesh. inpod-cni execs it only while the node agent cannot
// be reached; see package plugin/apicheck.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/plugin/apicheck"
)

func main() {
	fs := flag.NewFlagSet("inpod-cni-apicheck", flag.ContinueOnError)
	access := fs.String("access", "/etc/cni/net.d/"+apiaccess.FileName, "the API access file the agent writes")
	namespace := fs.String("namespace", "", "the pod's namespace (required)")
	name := fs.String("name", "", "the pod's name (required)")
	timeout := fs.Duration("timeout", 5*time.Second, "bound on the whole check")
	err := envflag.Parse(fs, "inpod-cni-apicheck: decide a pod's mesh enrollment from the API server while the inpod agent is down; prints {\"enrolled\":...} as JSON", os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err == nil && (*namespace == "" || *name == "") {
		err = fmt.Errorf("--namespace and --name are required")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "inpod-cni-apicheck:", err)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	a, err := apiaccess.Read(*access)
	if err != nil {
		fmt.Fprintln(os.Stderr, "inpod-cni-apicheck:", err)
		os.Exit(1)
	}
	v, err := apicheck.Decide(ctx, a, *namespace, *name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "inpod-cni-apicheck:", err)
		os.Exit(1)
	}
	json.NewEncoder(os.Stdout).Encode(v)
}
