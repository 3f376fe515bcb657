// Package images builds container images for the test node without Docker
// or a registry: a static Go binary becomes the single layer of an image,
// written as a tarball that containerd imports.
package images

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Image is a Go main package to build into an image.
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
	bin := filepath.Join(outDir, binName)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, img.Package)
	cmd.Dir = img.Dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("images: build %s: %v: %s", img.Package, err, out)
	}
	layer, err := binaryLayer(bin, "/"+binName)
	if err != nil {
		return "", err
	}
	image, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return "", err
	}
	cf, err := image.ConfigFile()
	if err != nil {
		return "", err
	}
	cf = cf.DeepCopy()
	// Without a platform, containerd's import filters the image out.
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config.Entrypoint = []string{"/" + binName}
	image, err = mutate.ConfigFile(image, cf)
	if err != nil {
		return "", err
	}
	ref, err := name.NewTag(img.Ref)
	if err != nil {
		return "", fmt.Errorf("images: %s: %w", img.Ref, err)
	}
	out := filepath.Join(outDir, binName+".tar")
	if err := tarball.WriteToFile(out, ref, image); err != nil {
		return "", fmt.Errorf("images: write %s: %w", out, err)
	}
	return out, nil
}

func binaryLayer(path, inImage string) (v1.Layer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: inImage[1:], Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	})
}
