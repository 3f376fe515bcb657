package release_test

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

// machines is the ELF machine each platform's binaries must be built for.
var machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// TestShippedImagesAreIndexesOfEveryPlatform: each shipped image is one OCI
// image index holding an image for linux/amd64 and one for linux/arm64,
// named for containerd's import, its digest the one the values file pins;
// every ELF file of a platform's image (the Go binaries, the iptables
// tools, their libraries and extensions) is built for that platform.
func TestShippedImagesAreIndexesOfEveryPlatform(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	_, images := built(t)
	for _, b := range images {
		t.Run(b.Name, func(t *testing.T) {
			dir := t.TempDir()
			idx, err := release.ReadIndex(b.File, dir)
			if err != nil {
				t.Fatal(err)
			}
			if d, _ := idx.Digest(); d != b.Digest {
				t.Errorf("the index's digest is %s, BuildImages reported %s", d, b.Digest)
			}
			if mt, _ := idx.MediaType(); mt != types.OCIImageIndex {
				t.Errorf("media type %s, want %s", mt, types.OCIImageIndex)
			}
			var top v1.IndexManifest
			data, err := os.ReadFile(filepath.Join(dir, "index.json"))
			if err == nil {
				err = json.Unmarshal(data, &top)
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := top.Manifests[0].Annotations["io.containerd.image.name"]; got != b.Ref() {
				t.Errorf("index.json names the image %q for containerd's import, want %q", got, b.Ref())
			}
			m, err := idx.IndexManifest()
			if err != nil {
				t.Fatal(err)
			}
			var platforms []string
			for _, d := range m.Manifests {
				platforms = append(platforms, d.Platform.String())
			}
			if got := strings.Join(platforms, " "); got != "linux/amd64 linux/arm64" {
				t.Fatalf("platforms %s, want linux/amd64 linux/arm64", got)
			}
			for _, arch := range release.Platforms {
				img, err := release.PlatformImage(idx, arch)
				if err != nil {
					t.Fatal(err)
				}
				cf, err := img.ConfigFile()
				if err != nil {
					t.Fatal(err)
				}
				if cf.OS != "linux" || cf.Architecture != arch {
					t.Errorf("linux/%s image's config says %s/%s", arch, cf.OS, cf.Architecture)
				}
				root := t.TempDir()
				extract(t, img, root)
				elves := 0
				err = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
					if err != nil || !d.Type().IsRegular() {
						return err
					}
					f, err := elf.Open(p)
					if err != nil {
						return nil // not ELF
					}
					defer f.Close()
					elves++
					if f.Machine != machines[arch] {
						t.Errorf("linux/%s image: %s is built for %s", arch, strings.TrimPrefix(p, root), f.Machine)
					}
					return nil
				})
				if err != nil {
					t.Fatal(err)
				}
				if elves == 0 {
					t.Errorf("linux/%s image: no ELF file", arch)
				}
			}
		})
	}
}

// TestShippedImagesPushWithTheirDigests pushes each image index, read from
// its tarball as `crane push <unpacked layout> <ref>` reads it, to a real
// (in-process) registry: the registry serves it under the digest the values
// file pins, and each platform's image under its own, as a pull for that
// platform resolves it.
func TestShippedImagesPushWithTheirDigests(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	_, images := built(t)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	for _, b := range images {
		idx, err := release.ReadIndex(b.File, t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		ref, err := name.ParseReference(host+"/inpod-dev/"+b.Name+":"+b.Tag, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.WriteIndex(ref, idx); err != nil {
			t.Fatalf("push %s: %v", b.Name, err)
		}
		got, err := remote.Get(ref)
		if err != nil {
			t.Fatal(err)
		}
		if got.Digest != b.Digest {
			t.Errorf("%s: the registry serves digest %s, the values file pins %s", b.Name, got.Digest, b.Digest)
		}
		m, err := idx.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range m.Manifests {
			img, err := remote.Image(ref, remote.WithPlatform(*d.Platform))
			if err != nil {
				t.Fatalf("%s: pull for %s: %v", b.Name, d.Platform, err)
			}
			if pd, _ := img.Digest(); pd != d.Digest {
				t.Errorf("%s: a pull for %s resolves %s, the index holds %s", b.Name, d.Platform, pd, d.Digest)
			}
		}
	}
}

// TestArm64ImagesRunUnderQEMU runs the linux/arm64 images' programs from
// their own root filesystems under qemu-user (qemu-aarch64-static -L
// <root>: the emulated loader and libraries are the image's, none of this
// machine's): every Go binary answers --help (the CNI plugin its VERSION),
// and every iptables tool the agent's backends run loads its libraries and
// the match and target extensions the rules use. qemu-user cannot carry
// netfilter's netlink or socket options, so applying rules is proven on
// this machine's platform (TestAgentImageRunsIPTablesBackends) and not
// here.
func TestArm64ImagesRunUnderQEMU(t *testing.T) {
	if _, err := os.Stat("/usr/sbin/xtables-nft-multi"); err != nil {
		t.Skip("needs Debian's iptables package (the agent image takes its tools from this machine)")
	}
	qemu, err := exec.LookPath("qemu-aarch64-static")
	if err != nil {
		t.Fatal("needs qemu-aarch64-static (Debian's qemu-user-static; hack/install-deps.sh installs it)")
	}
	dir, images := built(t)
	roots := map[string]string{}
	for _, b := range images {
		root := t.TempDir()
		extract(t, platformImage(t, filepath.Join(dir, b.Name+".tar"), "arm64"), root)
		roots[b.Name] = root
	}
	run := func(t *testing.T, image string, env []string, path string, args ...string) string {
		t.Helper()
		root := roots[image]
		cmd := exec.Command(qemu, append([]string{"-L", root, filepath.Join(root, path)}, args...)...)
		cmd.Env = append([]string{"PATH=/usr/sbin:/usr/bin"}, env...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s %s %s under qemu: %v\n%s", image, path, strings.Join(args, " "), err, out.String())
		}
		return out.String()
	}
	t.Run("go-binaries", func(t *testing.T) {
		for _, c := range []struct{ image, path, want string }{
			{"inpod-agent", release.AgentBinary, "Usage: inpod-agent"},
			{"inpod-agent", release.ProbeBinary, "usage: inpod-probe"},
			{"inpod-agent", release.CNIDir + "/inpod-cni-apicheck", "inpod-cni-apicheck"},
			{"inpod-controller", release.ControllerBinary, "inpod-controller"},
			{"inpod-waitready", release.WaitReadyBinary, "inpod-waitready"},
		} {
			if out := run(t, c.image, nil, c.path, "--help"); !strings.Contains(out, c.want) {
				t.Errorf("%s --help printed no %q:\n%s", c.path, c.want, out)
			}
		}
		if out := run(t, "inpod-agent", []string{"CNI_COMMAND=VERSION"}, release.CNIDir+"/inpod-cni"); !strings.Contains(out, `"supportedVersions"`) {
			t.Errorf("inpod-cni VERSION printed:\n%s", out)
		}
	})
	t.Run("iptables", func(t *testing.T) {
		for _, fam := range []string{"iptables", "ip6tables"} {
			for _, tool := range []string{fam + "-nft-restore", fam + "-nft-save", fam + "-legacy-restore", fam + "-legacy-save", fam + "-legacy"} {
				if out := run(t, "inpod-agent", nil, "/usr/sbin/"+tool, "--version"); !strings.Contains(out, " v") {
					t.Errorf("%s --version printed:\n%s", tool, out)
				}
			}
			// The matches and targets of agent/redirect's rules, each
			// loaded from the image's xtables directory.
			for _, target := range []string{"CONNMARK", "CT", "REDIRECT", "ACCEPT"} {
				out := run(t, "inpod-agent", nil, "/usr/sbin/"+fam+"-legacy", "-m", "connmark", "-m", "mark", "-p", "tcp", "-m", "tcp", "-m", "udp", "-j", target, "-h")
				for _, want := range []string{"connmark match options", "mark match options", "tcp match options", "udp match options"} {
					if !strings.Contains(out, want) {
						t.Errorf("%s -j %s -h: no %q: an extension did not load:\n%s", fam, target, want, out)
					}
				}
				if target != "ACCEPT" && !strings.Contains(out, target+" target options") {
					t.Errorf("%s -j %s -h: the target's extension did not load:\n%s", fam, target, out)
				}
			}
		}
	})
}

// TestRootFilesPassOverLibrariesOfAnotherMachine: on a multiarch machine a
// library of the wrong architecture can sit earlier on the loader's path
// (here this machine's libmnl, copied where the arm64 loader looks first);
// the arm64 image takes the arm64 one, as the loader would, and nothing of
// another machine.
func TestRootFilesPassOverLibrariesOfAnotherMachine(t *testing.T) {
	native, err := filepath.EvalSymlinks("/usr/lib/" + release.Triplet(runtime.GOARCH) + "/libmnl.so.0")
	if err != nil || runtime.GOARCH == "arm64" {
		t.Skip("needs this machine's libmnl (Debian's iptables package) on a non-arm64 machine")
	}
	debian, _, err := release.DebianRoot(context.Background(), testkit.RepoDir(t), "arm64")
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if out, err := exec.Command("cp", "-a", debian+"/.", root).CombinedOutput(); err != nil {
		t.Fatalf("copy the arm64 root: %v: %s", err, out)
	}
	wrong := filepath.Join(root, "lib/aarch64-linux-gnu")
	if err := os.MkdirAll(wrong, 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(native)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(wrong, "libmnl.so.0"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	files, err := release.RootFiles(root, "arm64", "/usr/sbin/xtables-nft-multi")
	if err != nil {
		t.Fatal(err)
	}
	var tookMnl bool
	for _, f := range files {
		if strings.Contains(f.Path, "libmnl") {
			tookMnl = tookMnl || strings.HasPrefix(f.Path, "/usr/lib/aarch64-linux-gnu/")
			if strings.HasPrefix(f.Path, "/lib/aarch64-linux-gnu/") {
				t.Errorf("took %s, this machine's library, into the arm64 image", f.Path)
			}
		}
		if len(f.Data) == 0 {
			continue
		}
		if e, err := elf.NewFile(bytes.NewReader(f.Data)); err == nil && e.Machine != elf.EM_AARCH64 {
			t.Errorf("%s is built for %s", f.Path, e.Machine)
		}
	}
	if !tookMnl {
		t.Error("the arm64 libmnl is not in the image")
	}
}
