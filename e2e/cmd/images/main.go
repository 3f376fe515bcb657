// Command images builds inpod's image tarballs without Docker (make
// images): inpod-agent, inpod-controller, inpod-waitready and
// ztunnel-standin (a test peer), written into --out and printed with their
// digests. Import them with `ctr -n k8s.io images import` or `docker load`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/envflag"
)

func main() {
	fs := flag.NewFlagSet("images", flag.ContinueOnError)
	out := fs.String("out", "bin/images", "directory for the image tarballs")
	repo := fs.String("repo", ".", "the inpod repository to build from")
	tag := fs.String("tag", images.DevTag, "the images' tag")
	err := envflag.Parse(fs, "images: build inpod's OCI image tarballs without Docker", os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err == nil {
		err = run(*repo, *tag, *out)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func run(repo, tag, out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	abs, err := filepath.Abs(repo)
	if err != nil {
		return err
	}
	digests, err := images.Products(context.Background(), abs, tag, out)
	if err != nil {
		return err
	}
	for _, f := range images.SortedKeys(digests) {
		fmt.Printf("%s  %s\n", digests[f], filepath.Join(out, f))
	}
	return nil
}
