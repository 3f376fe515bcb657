package release_test

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/release"
)

var shipped struct {
	once  sync.Once
	dir   string
	built []release.Built
	err   error
}

// built builds the shipped images once for the package's tests.
func built(t *testing.T) (string, []release.Built) {
	t.Helper()
	shipped.once.Do(func() {
		shipped.dir, shipped.err = os.MkdirTemp("", "inpod-images-")
		if shipped.err == nil {
			shipped.built, shipped.err = release.BuildImages(context.Background(), testkit.RepoDir(t), "test", shipped.dir, nil)
		}
	})
	if shipped.err != nil {
		t.Fatal(shipped.err)
	}
	return shipped.dir, shipped.built
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shipped.dir != "" {
		os.RemoveAll(shipped.dir)
	}
	os.Exit(code)
}

func TestShippedImagesAreReproducible(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	_, first := built(t)
	again := t.TempDir()
	second, err := release.BuildImages(context.Background(), testkit.RepoDir(t), "test", again, nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for i, b := range first {
		names = append(names, b.Name)
		if b.Digest != second[i].Digest || b.Name != second[i].Name {
			t.Errorf("%s: digest %s, then %s: %s from the same tree", b.Name, b.Digest, second[i].Name, second[i].Digest)
		}
	}
	if want := "inpod-agent inpod-controller inpod-waitready"; strings.Join(names, " ") != want {
		t.Errorf("built %v, want %s", names, want)
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
	img := platformImage(t, filepath.Join(dir, "inpod-agent.tar"), runtime.GOARCH)
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

// TestWaitReadyImageRunsUnprivileged runs the inpod-waitready image's
// binary from the image's own root filesystem (chrooted, nothing of the
// host but /proc), as the image's non-root user with no capabilities, in a
// netns with loopback only: it reads its netns from procfs and fails,
// naming what is missing, at its timeout. The image is the binary alone,
// a few MiB.
func TestWaitReadyImageRunsUnprivileged(t *testing.T) {
	netnstest.RequireRoot(t)
	dir, _ := built(t)
	img := platformImage(t, filepath.Join(dir, "inpod-waitready.tar"), runtime.GOARCH)
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != release.WaitReadyUser || len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != release.WaitReadyBinary {
		t.Fatalf("config: user %q entrypoint %v, want %s and %s", cf.Config.User, cf.Config.Entrypoint, release.WaitReadyUser, release.WaitReadyBinary)
	}
	root := t.TempDir()
	if err := os.Chmod(root, 0o755); err != nil {
		t.Fatal(err)
	}
	extract(t, img, root)
	bin, err := os.Stat(filepath.Join(root, release.WaitReadyBinary))
	if err != nil {
		t.Fatal(err)
	}
	const maxSize = 5 << 20
	if bin.Size() > maxSize {
		t.Errorf("inpod-waitready is %d bytes, want at most %d: it is pulled for every enrolled pod", bin.Size(), maxSize)
	}
	proc := filepath.Join(root, "proc")
	if err := os.MkdirAll(proc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc", proc, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(proc, unix.MNT_DETACH) })

	ns := netnstest.New(t)
	var out strings.Builder
	cmd := exec.Command(release.WaitReadyBinary, "--timeout=300ms")
	cmd.Path = release.WaitReadyBinary
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root, Credential: &syscall.Credential{Uid: 65532, Gid: 65532}}
	if err := netns.Do(ns.Open(t), cmd.Start); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	if cmd.ProcessState.ExitCode() != 1 || !strings.Contains(out.String(), "listeners on port 15001, 15006, 15008 are not bound") ||
		!strings.Contains(out.String(), "no route off the pod") {
		t.Fatalf("exit %v, output:\n%s\nwant exit 1 naming the missing listeners and the missing route", err, out.String())
	}
}

// platformImage is the linux/arch image of the image index in the tarball
// file.
func platformImage(t *testing.T, file, arch string) v1.Image {
	t.Helper()
	idx, err := release.ReadIndex(file, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	img, err := release.PlatformImage(idx, arch)
	if err != nil {
		t.Fatal(err)
	}
	return img
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
