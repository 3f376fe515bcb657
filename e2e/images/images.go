// Package images builds the test images of the end-to-end harness, with
// package release's generic builder (reproducible, without Docker): pause
// and testapp, imported into every test node, and ztunnel-standin, the test
// peer that plays ztunnel on the ZDS socket. The images inpod ships are
// package release's; BuildForChart writes them next to the stand-in for the
// tests and the demo that install the chart.
package images

import (
	"context"
	"path/filepath"

	"github.com/inpod-dev/inpod/release"
)

// Image is a Go main package to build into an image of its own.
type Image struct {
	// Ref is the image reference pods use, e.g. inpod.dev/e2e/testapp:dev.
	Ref string
	// Package is the Go package path of the main, e.g. ./e2e/images/testapp.
	Package string
	// Dir is the module directory to build in.
	Dir string
}

// Well-known images of the test node.
const (
	PauseRef   = "inpod.dev/e2e/pause:dev"
	TestAppRef = "inpod.dev/e2e/testapp:dev"
)

// Build compiles img statically and writes an image tarball into outDir,
// returning its path. The binary is the image's entrypoint, at /<name>.
func Build(ctx context.Context, img Image, outDir string) (string, error) {
	binName := filepath.Base(img.Package)
	data, err := release.GoBinary(ctx, img.Dir, img.Package)
	if err != nil {
		return "", err
	}
	out := filepath.Join(outDir, binName+".tar")
	_, err = release.Write(release.Spec{
		Ref:        img.Ref,
		Files:      []release.File{{Path: "/" + binName, Mode: 0o755, Data: data}},
		Entrypoint: []string{"/" + binName},
	}, out)
	return out, err
}
