package images_test

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

var products struct {
	once    sync.Once
	dir     string
	digests map[string]string
	err     error
}

// built builds the shipped images once for the package's tests.
func built(t *testing.T) (string, map[string]string) {
	t.Helper()
	products.once.Do(func() {
		products.dir, products.err = os.MkdirTemp("", "inpod-images-")
		if products.err == nil {
			products.digests, products.err = images.Products(context.Background(), testkit.RepoDir(t), "test", products.dir)
		}
	})
	if products.err != nil {
		t.Fatal(products.err)
	}
	return products.dir, products.digests
}

func TestMain(m *testing.M) {
	code := m.Run()
	if products.dir != "" {
		os.RemoveAll(products.dir)
	}
	os.Exit(code)
}

func TestProductImagesAreReproducible(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	_, first := built(t)
	again := t.TempDir()
	second, err := images.Products(context.Background(), testkit.RepoDir(t), "test", again)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"inpod-agent.tar", "inpod-controller.tar", "ztunnel-standin.tar"} {
		if first[f] == "" || first[f] != second[f] {
			t.Errorf("%s: digest %q, then %q from the same tree", f, first[f], second[f])
		}
	}
}

// TestAgentImageRunsIPTablesBackends runs the agent's real iptables
// backends against a real netns with the tools and libraries of the image
// (chrooted into its root filesystem), nothing from the host: apply,
// apply again (read back with the image's -save: nothing to change),
// remove.
func TestAgentImageRunsIPTablesBackends(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	dir, _ := built(t)
	root := t.TempDir()
	img, err := tarball.ImageFromPath(filepath.Join(dir, "inpod-agent.tar"), nil)
	if err != nil {
		t.Fatal(err)
	}
	extract(t, img, root)
	// iptables-legacy-save finds its tables in /proc/net (the netns of
	// the caller), as in the agent's container.
	proc := filepath.Join(root, "proc")
	if err := os.MkdirAll(proc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc", proc, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(proc, unix.MNT_DETACH) })

	// The backends find their tools on PATH: point each name at the
	// image's copy, run chrooted.
	chroot, err := exec.LookPath("chroot")
	if err != nil {
		t.Skip("needs chroot (coreutils)")
	}
	wrappers := t.TempDir()
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, mode := range []string{"nft", "legacy"} {
			for _, op := range []string{"restore", "save"} {
				name := fam + "-" + mode + "-" + op
				script := "#!/bin/sh\nexec " + chroot + " " + root + " /usr/sbin/" + name + " \"$@\"\n"
				if err := os.WriteFile(filepath.Join(wrappers, name), []byte(script), 0o755); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	t.Setenv("PATH", wrappers+":"+os.Getenv("PATH"))

	for _, mode := range []redirect.IPTablesMode{redirect.IPTablesNFT, redirect.IPTablesLegacy} {
		t.Run(string(mode), func(t *testing.T) {
			ns := netnstest.New(t)
			fd := ns.Open(t)
			b, err := redirect.NewIPTables(mode)
			if err != nil {
				t.Fatal(err)
			}
			e := redirect.NewEngine(b)
			opts := redirect.Options{DNSCapture: true}
			res, err := e.Apply(fd, opts)
			if err != nil {
				t.Fatalf("apply with the image's tools: %v", err)
			}
			if !res.Changed || len(res.Families) != 2 {
				t.Fatalf("first apply: %+v, want changed in both families", res)
			}
			host := ns.Exec(t, "/usr/sbin/iptables-"+string(mode)+"-save")
			if !strings.Contains(host, "15001") || !strings.Contains(host, "15053") {
				t.Fatalf("the host's iptables-%s-save does not show the rules the image wrote:\n%s", mode, host)
			}
			res, err = e.Apply(fd, opts)
			if err != nil || res.Changed {
				t.Fatalf("second apply: %+v, %v; want nothing changed (the image's -save read the rules back)", res, err)
			}
			if _, err := e.Remove(fd); err != nil {
				t.Fatal(err)
			}
			if host := ns.Exec(t, "/usr/sbin/iptables-"+string(mode)+"-save"); strings.Contains(host, "15001") {
				t.Fatalf("rules left after Remove:\n%s", host)
			}
		})
	}
}

// extract writes img's flattened filesystem under root.
func extract(t *testing.T, img v1.Image, root string) {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(root, h.Name)
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, os.FileMode(h.Mode)&os.ModePerm)
		case tar.TypeSymlink:
			err = os.Symlink(h.Linkname, p)
		case tar.TypeReg:
			var f *os.File
			if f, err = os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&os.ModePerm); err == nil {
				_, err = io.Copy(f, tr)
				f.Close()
			}
		default:
			t.Fatalf("unexpected entry %s (type %c)", h.Name, h.Typeflag)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}
