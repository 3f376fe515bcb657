// Package release builds what inpod ships, outside the test harness and
// without Docker or a registry: the images inpod-agent, inpod-controller
// and inpod-waitready (Agent, Controller, WaitReady; BuildImages), and,
// through cmd/inpod-release (make images, make release), the chart packaged
// with a values file that pins those images by digest. The end-to-end
// harness (e2e/) takes the shipped images from here, and builds its own
// test images with this package's generic builder: Go binaries built from
// this repository (GoBinary) and, for the agent, the iptables tools copied
// from the build machine's Debian packages (HostFiles) become one layer
// (Layer), written (Write) as an image tarball in the docker-archive format
// (`docker save`'s) that containerd imports (`ctr images import`),
// `docker load` reads and `crane push` pushes with the same digest.
//
// The images are reproducible: the layer's entries are sorted, owned by
// root and dated at the epoch, the config carries no creation time, and the
// binaries are built with -trimpath; the same commit (and, for the agent,
// the same Debian packages) gives the same digest.
package release

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// GoBinary builds a Go main package of the module in dir as a static,
// stripped, path-independent binary and returns its bytes.
func GoBinary(ctx context.Context, dir, pkg string) ([]byte, error) {
	tmp, err := os.MkdirTemp("", "inpod-image-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	bin := filepath.Join(tmp, "bin")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("release: build %s: %v: %s", pkg, err, out)
	}
	return os.ReadFile(bin)
}

// File is one entry of an image's layer.
type File struct {
	// Path is absolute in the image.
	Path string
	// Mode holds the permission bits.
	Mode int64
	// Data is a regular file's content.
	Data []byte
	// Link, when set, makes the entry a symlink to it.
	Link string
	// Dir makes the entry a directory.
	Dir bool
}

// Spec is an image: its files (one layer) and its config.
type Spec struct {
	Ref        string
	Files      []File
	Entrypoint []string
	Env        []string
	Labels     map[string]string
	// User is the config's user (uid:gid); empty: root.
	User string
}

// Write writes spec as an image tarball tagged spec.Ref to out and returns
// the image's digest.
func Write(spec Spec, out string) (v1.Hash, error) {
	img, err := spec.image()
	if err != nil {
		return v1.Hash{}, err
	}
	ref, err := name.NewTag(spec.Ref)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("release: %s: %w", spec.Ref, err)
	}
	if err := tarball.WriteToFile(out, ref, img); err != nil {
		return v1.Hash{}, fmt.Errorf("release: write %s: %w", out, err)
	}
	return img.Digest()
}

func (spec Spec) image() (v1.Image, error) {
	layer, err := Layer(spec.Files)
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	// Without a platform, containerd's import filters the image out.
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config.Entrypoint = spec.Entrypoint
	cf.Config.Env = spec.Env
	cf.Config.Labels = spec.Labels
	cf.Config.User = spec.User
	return mutate.ConfigFile(img, cf)
}

// epoch dates every entry, so the layer depends on content only.
var epoch = time.Unix(0, 0)

// Layer is a reproducible layer of files: every parent directory is added,
// entries are sorted by path and carry no owner, time or host metadata.
func Layer(files []File) (v1.Layer, error) {
	byPath := map[string]File{}
	for _, f := range files {
		p := path.Clean(f.Path)
		if !path.IsAbs(p) || p == "/" {
			return nil, fmt.Errorf("release: bad path %q", f.Path)
		}
		f.Path = p
		if old, ok := byPath[p]; ok && !(old.Dir && f.Dir) {
			return nil, fmt.Errorf("release: %s added twice", p)
		}
		byPath[p] = f
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := byPath[d]; !ok {
				byPath[d] = File{Path: d, Dir: true, Mode: 0o755}
			}
		}
	}
	paths := make([]string, 0, len(byPath))
	for p := range byPath {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, p := range paths {
		f := byPath[p]
		h := &tar.Header{Name: strings.TrimPrefix(p, "/"), Mode: f.Mode, ModTime: epoch}
		switch {
		case f.Dir:
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		case f.Link != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, f.Link, 0o777
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.Data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	})
}
