// Command inpod-release builds a release of inpod without Docker (make
// release): into --out, the shipped images inpod-agent, inpod-controller
// and inpod-waitready, each one OCI image index for linux/amd64 and
// linux/arm64 (--platforms) in an OCI layout tarball, values-release.yaml
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
	"strings"

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
	platforms := fs.String("platforms", strings.Join(release.Platforms, ","), "the linux architectures each image's index holds, comma-separated; another than this machine's takes Debian's iptables packages of that architecture (hack/debian-root.sh, apt-get)")
	err := envflag.Parse(fs, "inpod-release: build inpod's images, its packaged chart and a values file pinning the images by digest, without Docker", os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err == nil && fs.NArg() > 0 {
		err = fmt.Errorf("unexpected arguments %q (flags only)", fs.Args())
	}
	var archs []string
	if err == nil {
		archs, err = parsePlatforms(*platforms)
	}
	if err == nil {
		err = run(context.Background(), *repo, *tag, *out, *chart, *helm, archs)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "inpod-release:", err)
		os.Exit(1)
	}
}

// parsePlatforms reads --platforms: architectures (amd64) or platforms
// (linux/amd64), each once.
func parsePlatforms(s string) ([]string, error) {
	var archs []string
	seen := map[string]bool{}
	for _, p := range strings.Split(s, ",") {
		arch := strings.TrimPrefix(strings.TrimSpace(p), "linux/")
		switch {
		case arch == "":
			return nil, fmt.Errorf("--platforms %q: an empty entry", s)
		case strings.Contains(arch, "/"):
			return nil, fmt.Errorf("--platforms %q: %q: only linux platforms (linux/<arch> or <arch>)", s, p)
		case seen[arch]:
			return nil, fmt.Errorf("--platforms %q: %s twice", s, arch)
		}
		seen[arch] = true
		archs = append(archs, arch)
	}
	return archs, nil
}

func run(ctx context.Context, repo, tag, out, chart, helm string, archs []string) error {
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
	built, err := release.BuildImages(ctx, abs, tag, out, archs)
	if err != nil {
		return err
	}
	values := filepath.Join(out, release.ValuesFile)
	if err := os.WriteFile(values, release.Values(built), 0o644); err != nil {
		return err
	}
	for _, b := range built {
		fmt.Printf("%s  %s  image index %s (linux/%s)\n", b.Digest, b.File, b.Ref(), strings.Join(b.Archs, ", linux/"))
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
