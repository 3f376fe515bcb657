// Command inpod-release builds a release of inpod without Docker (make
// release): into --out, the shipped images inpod-agent, inpod-controller
// and inpod-waitready as image tarballs (docker-archive), values-release.yaml
// pinning each image to its repository and digest, and the chart packaged
// by helm (versioned from --tag when it is a semantic version). Each
// artifact is printed with its digest. With --chart empty it writes the
// images and the values file only (make images).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/release"
)

func main() {
	fs := flag.NewFlagSet("inpod-release", flag.ContinueOnError)
	out := fs.String("out", "bin/release", "directory for the artifacts")
	repo := fs.String("repo", ".", "the inpod repository to build from")
	tag := fs.String("tag", release.DevTag, "the images' tag; a semantic version (v1.2.3) also versions the chart")
	chart := fs.String("chart", "deploy/helm/inpod", "the chart to package; empty: the images and the values file only")
	helm := fs.String("helm", "bin/helm", "the helm binary that packages the chart")
	err := envflag.Parse(fs, "inpod-release: build inpod's images, its packaged chart and a values file pinning the images by digest, without Docker", os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err == nil && fs.NArg() > 0 {
		err = fmt.Errorf("unexpected arguments %q (flags only)", fs.Args())
	}
	if err == nil {
		err = run(context.Background(), *repo, *tag, *out, *chart, *helm)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "inpod-release:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, repo, tag, out, chart, helm string) error {
	if chart != "" {
		// Before minutes of image builds.
		if _, err := exec.LookPath(helm); err != nil {
			return fmt.Errorf("helm packages the chart: %w (make deps installs bin/helm)", err)
		}
		if _, err := os.Stat(filepath.Join(chart, "Chart.yaml")); err != nil {
			return fmt.Errorf("--chart: %w", err)
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	abs, err := filepath.Abs(repo)
	if err != nil {
		return err
	}
	built, err := release.BuildImages(ctx, abs, tag, out)
	if err != nil {
		return err
	}
	values := filepath.Join(out, release.ValuesFile)
	if err := os.WriteFile(values, release.Values(built), 0o644); err != nil {
		return err
	}
	for _, b := range built {
		fmt.Printf("%s  %s  image %s\n", b.Digest, b.File, b.Ref())
	}
	if err := printFile(values, "pins the images by digest"); err != nil {
		return err
	}
	if chart == "" {
		return nil
	}
	pkg, err := release.PackageChart(ctx, helm, chart, tag, out)
	if err != nil {
		return err
	}
	what := "chart, version from Chart.yaml (--tag is not a semantic version)"
	if v, ok := release.ChartVersion(tag); ok {
		what = "chart " + v + ", appVersion " + tag
	}
	return printFile(pkg, what)
}

func printFile(p, what string) error {
	d, err := release.FileDigest(p)
	if err != nil {
		return err
	}
	fmt.Printf("%s  %s  %s (the file's digest)\n", d, p, what)
	return nil
}
