// Package release builds what inpod ships, outside the test harness and
// without Docker or a registry: the images inpod-agent, inpod-controller
// and inpod-waitready (Agent, Controller, WaitReady; BuildImages), and,
// through cmd/inpod-release (make images, make release), the chart packaged
// with a values file that pins those images by digest.
//
// A shipped image is one OCI image index with an image per platform
// (Platforms: linux/amd64 and linux/arm64), written (WriteIndex) as an OCI
// image layout in a tarball (an "oci-archive") that containerd imports
// (`ctr images import`) and skopeo and crane push with the index's digest.
// Each platform's image is one layer (Layer) of Go binaries built from
// this repository (GoBinaryFor) and, for the agent, Debian's iptables
// tools of that architecture (RootFiles: this machine's own for its
// platform, the same versions' packages unpacked by hack/debian-root.sh for
// the other; DebianRoot). The end-to-end harness (e2e/) takes the shipped
// images from here, and builds its own test images, for this machine only,
// with the same builder (GoBinary, Write: one image in the docker-archive
// format, `docker save`'s).
//
// The images are reproducible: the layer's entries are sorted, owned by
// root and dated at the epoch, the config carries no creation time, and the
// binaries are built with -trimpath; the same commit and the same Debian
// packages give the same digests.
package release

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
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
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Platforms are the architectures (GOARCH, which is also the OCI
// platform's architecture) every shipped image is built for, on linux.
var Platforms = []string{"amd64", "arm64"}

// GoBinary builds a Go main package of the module in dir as a static,
// stripped, path-independent binary for this machine and returns its
// bytes.
func GoBinary(ctx context.Context, dir, pkg string) ([]byte, error) {
	return GoBinaryFor(ctx, dir, pkg, runtime.GOARCH)
}

// GoBinaryFor is GoBinary for linux/arch: Go cross-compiles without a C
// toolchain, since the binaries are static (CGO_ENABLED=0).
func GoBinaryFor(ctx context.Context, dir, pkg, arch string) ([]byte, error) {
	tmp, err := os.MkdirTemp("", "inpod-image-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	bin := filepath.Join(tmp, "bin")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("release: build %s for linux/%s: %v: %s", pkg, arch, err, out)
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
	// Arch is the platform's architecture (linux/<Arch>); empty: this
	// machine's.
	Arch string
}

func (spec Spec) arch() string {
	if spec.Arch == "" {
		return runtime.GOARCH
	}
	return spec.Arch
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

// WriteIndex writes the images of specs, one per platform, as one OCI image
// index tagged ref (also its name for containerd's import) in an OCI image
// layout tarball at out, and returns the index's digest: the one a
// registry gives it once pushed.
func WriteIndex(ref string, specs []Spec, out string) (v1.Hash, error) {
	tag, err := name.NewTag(ref)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("release: %s: %w", ref, err)
	}
	var adds []mutate.IndexAddendum
	seen := map[string]bool{}
	for _, spec := range specs {
		if seen[spec.arch()] {
			return v1.Hash{}, fmt.Errorf("release: %s: two images for linux/%s", ref, spec.arch())
		}
		seen[spec.arch()] = true
		img, err := spec.ociImage()
		if err != nil {
			return v1.Hash{}, err
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: spec.arch()}}})
	}
	idx := mutate.AppendManifests(empty.Index, adds...)
	dir, err := os.MkdirTemp("", "inpod-oci-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	// containerd's import names the image after io.containerd.image.name;
	// tools of the OCI world (skopeo, oras) read the tag from ref.name.
	if err := lp.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          tag.Name(),
		"org.opencontainers.image.ref.name": tag.TagStr(),
	})); err != nil {
		return v1.Hash{}, fmt.Errorf("release: %s: %w", ref, err)
	}
	if err := tarTree(dir, out); err != nil {
		return v1.Hash{}, err
	}
	return idx.Digest()
}

// tarTree writes the files under dir into a tarball at out, reproducibly:
// entries sorted, dated at the epoch, owned by no one.
func tarTree(dir, out string) error {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(paths)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	for _, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		h := &tar.Header{Name: filepath.ToSlash(rel), Mode: 0o644, ModTime: epoch, Typeflag: tar.TypeReg, Size: fi.Size()}
		if fi.IsDir() {
			h.Name, h.Mode, h.Typeflag, h.Size = h.Name+"/", 0o755, tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.IsDir() {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if _, err := tw.Write(data); err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

// ReadIndex unpacks an image tarball WriteIndex wrote into dir and returns
// its image index.
func ReadIndex(file, dir string) (v1.ImageIndex, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("release: %s: %w", file, err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(p, filepath.Clean(dir)+string(filepath.Separator)) {
			return nil, fmt.Errorf("release: %s: entry %q outside the layout", file, h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			var data []byte
			if data, err = io.ReadAll(tr); err == nil {
				err = os.WriteFile(p, data, 0o644)
			}
		default:
			err = fmt.Errorf("unexpected entry %s (type %c)", h.Name, h.Typeflag)
		}
		if err != nil {
			return nil, fmt.Errorf("release: %s: %w", file, err)
		}
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("release: %s: %w", file, err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(m.Manifests) != 1 {
		return nil, fmt.Errorf("release: %s: %d entries in index.json, want the image index alone", file, len(m.Manifests))
	}
	return top.ImageIndex(m.Manifests[0].Digest)
}

// PlatformImage is the image of idx for linux/arch.
func PlatformImage(idx v1.ImageIndex, arch string) (v1.Image, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	for _, d := range m.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch {
			return idx.Image(d.Digest)
		}
	}
	return nil, fmt.Errorf("release: no linux/%s image in the index", arch)
}

// ociImage is the image with OCI media types throughout, as an OCI index
// holds them.
func (spec Spec) ociImage() (v1.Image, error) {
	img, err := spec.build(types.OCIManifestSchema1, types.OCILayer)
	if err != nil {
		return nil, err
	}
	return mutate.ConfigMediaType(img, types.OCIConfigJSON), nil
}

func (spec Spec) image() (v1.Image, error) {
	return spec.build(types.DockerManifestSchema2, types.DockerLayer)
}

func (spec Spec) build(manifestType, layerType types.MediaType) (v1.Image, error) {
	layer, err := layerOf(spec.Files, layerType)
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, manifestType), layer)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	// Without a platform, containerd's import filters the image out.
	cf.OS, cf.Architecture = "linux", spec.arch()
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
func Layer(files []File) (v1.Layer, error) { return layerOf(files, types.DockerLayer) }

func layerOf(files []File, mediaType types.MediaType) (v1.Layer, error) {
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
	}, tarball.WithMediaType(mediaType))
}
