package release_test

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/inpod-dev/inpod/release"
)

// TestLayerIsReproducible: the same files in any order give the same layer,
// with every parent directory added, entries sorted, dated at the epoch and
// owned by no one; a path given twice is refused.
func TestLayerIsReproducible(t *testing.T) {
	files := []release.File{
		{Path: "/usr/local/bin/b", Mode: 0o755, Data: []byte("b")},
		{Path: "/etc/a", Mode: 0o644, Data: []byte("a")},
		{Path: "/usr/sbin/l", Link: "../local/bin/b"},
	}
	reversed := []release.File{files[2], files[1], files[0]}
	one, err := release.Layer(files)
	if err != nil {
		t.Fatal(err)
	}
	two, err := release.Layer(reversed)
	if err != nil {
		t.Fatal(err)
	}
	d1, _ := one.Digest()
	d2, _ := two.Digest()
	if d1 != d2 {
		t.Errorf("layer digest %s, then %s for the same files in another order", d1, d2)
	}
	rc, err := one.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	var names []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.ModTime.Unix() != 0 || h.Uid != 0 || h.Gid != 0 || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: time %v, owner %d:%d %q:%q; want the epoch and no owner", h.Name, h.ModTime, h.Uid, h.Gid, h.Uname, h.Gname)
		}
		names = append(names, h.Name)
	}
	want := "etc/ etc/a usr/ usr/local/ usr/local/bin/ usr/local/bin/b usr/sbin/ usr/sbin/l"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("entries %s, want %s", got, want)
	}
	if _, err := release.Layer(append(files, release.File{Path: "/etc/a", Data: []byte("again")})); err == nil {
		t.Error("a path given twice was accepted")
	}
}

// TestWrittenImageKeepsItsDigest: the tarball Write writes is a
// docker-archive (docker save's format: manifest.json, no OCI layout), read
// back with the digest Write returned, and pushed (as crane push does)
// under that same digest: the one values-release.yaml pins.
func TestWrittenImageKeepsItsDigest(t *testing.T) {
	out := filepath.Join(t.TempDir(), "img.tar")
	digest, err := release.Write(release.Spec{
		Ref:        "example.com/inpod/test:v1",
		Files:      []release.File{{Path: "/bin/x", Mode: 0o755, Data: []byte("#!/bin/x\n")}},
		Entrypoint: []string{"/bin/x"},
		Labels:     map[string]string{"a": "b"},
	}, out)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	entries := map[string]bool{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		entries[h.Name] = true
	}
	if !entries["manifest.json"] || entries["index.json"] || entries["oci-layout"] {
		t.Errorf("tarball entries %v: want a docker-archive (manifest.json, no index.json or oci-layout)", entries)
	}

	img, err := tarball.ImageFromPath(out, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d, err := img.Digest(); err != nil || d != digest {
		t.Fatalf("read back: digest %s (%v), want %s", d, err, digest)
	}
	// What a push sends: crane push (go-containerregistry's remote.Write)
	// puts these manifest bytes, whose digest the registry then gives.
	raw, err := img.RawManifest()
	if err != nil {
		t.Fatal(err)
	}
	if d := sha256.Sum256(raw); "sha256:"+hex.EncodeToString(d[:]) != digest.String() {
		t.Errorf("the manifest a push sends has digest sha256:%x, want %s", d, digest)
	}
}
