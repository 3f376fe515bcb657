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
	"github.com/inpod-dev/inpod/release"
)

func main() {
	fs := flag.NewFlagSet("images", flag.ContinueOnError)
	out := fs.String("out", "bin/images", "directory for the image tarballs")
	repo := fs.String("repo", ".", "the inpod repository to build from")
	tag := fs.String("tag", release.DevTag, "the images' tag")
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
	built, err := release.BuildImages(context.Background(), abs, tag, out)
	if err != nil {
		return err
	}
	for _, b := range built {
		fmt.Printf("%s  %s\n", b.Digest, b.File)
	}
	standIn, err := images.WriteStandIn(context.Background(), abs, tag, out)
	if err != nil {
		return err
	}
	fmt.Printf("%s  (test peer)\n", standIn)
	return nil
}
