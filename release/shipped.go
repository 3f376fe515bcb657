package release

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// The images inpod ships. Their repositories are the chart's defaults;
// the tag is the version, DevTag for local builds.
const (
	AgentRepository      = "ghcr.io/inpod-dev/inpod-agent"
	ControllerRepository = "ghcr.io/inpod-dev/inpod-controller"
	WaitReadyRepository  = "ghcr.io/inpod-dev/inpod-waitready"
	DevTag               = "dev"
)

// Paths inside the agent image. CNIDir is the agent's --cni-source-dir
// default: the plugin binaries it copies onto the node.
const (
	AgentBinary      = "/usr/local/bin/inpod-agent"
	ProbeBinary      = "/usr/local/bin/inpod-probe" // the agent container's exec probe
	ControllerBinary = "/usr/local/bin/inpod-controller"
	WaitReadyBinary  = "/usr/local/bin/inpod-waitready"
	CNIDir           = "/opt/inpod/bin"
)

// iptablesTools are the commands the agent's iptables backends run
// (agent/redirect: <family>-<mode>-restore and -save), plus the plain
// commands for a person debugging inside the container. All are links to
// the xtables multi-binaries of Debian's iptables package.
var iptablesTools = func() []string {
	var out []string
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, mode := range []string{"nft", "legacy"} {
			for _, suffix := range []string{"", "-restore", "-save"} {
				out = append(out, "/usr/sbin/"+fam+"-"+mode+suffix)
			}
		}
	}
	return out
}()

// Agent is the inpod-agent image for linux/arch: the agent (entrypoint),
// its exec probe, inpod-cni and inpod-cni-apicheck in CNIDir for the agent to install on
// the node, and the iptables tools with their libraries and match/target
// extensions from Debian's iptables package, so every redirection backend
// runs from the image. The default backend, nftables, needs none of them
// (netlink). For this machine's architecture the tools are its own; for
// another, the same iptables version's packages of that architecture
// (DebianRoot).
func Agent(ctx context.Context, repoDir, tag, arch string) (Spec, error) {
	root, iptablesVersion, err := DebianRoot(ctx, repoDir, arch)
	if err != nil {
		return Spec{}, err
	}
	var files []File
	for _, b := range []struct{ pkg, path string }{
		{"./cmd/inpod-agent", AgentBinary},
		{"./cmd/inpod-probe", ProbeBinary},
		{"./cmd/inpod-cni", CNIDir + "/inpod-cni"},
		{"./cmd/inpod-cni-apicheck", CNIDir + "/inpod-cni-apicheck"},
	} {
		data, err := GoBinaryFor(ctx, repoDir, b.pkg, arch)
		if err != nil {
			return Spec{}, err
		}
		files = append(files, File{Path: b.path, Mode: 0o755, Data: data})
	}
	exts, err := filepath.Glob(filepath.Join(root, "/usr/lib", Triplet(arch), "xtables", "lib*.so"))
	if err != nil {
		return Spec{}, err
	}
	// Bridge and ARP extensions are for ebtables/arptables, which inpod
	// never runs.
	var keep []string
	for _, e := range exts {
		base := filepath.Base(e)
		if strings.HasPrefix(base, "libxt_") || strings.HasPrefix(base, "libipt_") || strings.HasPrefix(base, "libip6t_") {
			keep = append(keep, strings.TrimPrefix(e, filepath.Clean(root)))
		}
	}
	if len(keep) == 0 {
		return Spec{}, fmt.Errorf("release: no xtables extensions under %s: apt-get install iptables", root)
	}
	host, err := RootFiles(root, arch, append(append([]string{}, iptablesTools...), keep...)...)
	if err != nil {
		return Spec{}, fmt.Errorf("%w (the agent image takes the iptables tools from Debian's packages: apt-get install iptables)", err)
	}
	files = append(files, host...)
	// iptables-legacy takes its lock in /run; the chart mounts an emptyDir
	// there, so the root filesystem can stay read-only.
	files = append(files, File{Path: "/run", Dir: true, Mode: 0o755}, File{Path: "/tmp", Dir: true, Mode: 0o1777})
	labels := map[string]string{
		"org.opencontainers.image.title":       "inpod-agent",
		"org.opencontainers.image.description": "inpod node agent: CNI plugin installer, pod redirection, ZDS server, scheduling gates",
		"org.opencontainers.image.source":      "https://github.com/inpod-dev/inpod",
	}
	if iptablesVersion != "" {
		labels["dev.inpod.iptables-debian-version"] = iptablesVersion
	}
	return Spec{
		Ref:        AgentRepository + ":" + tag,
		Files:      files,
		Entrypoint: []string{AgentBinary},
		Env:        []string{"PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Labels:     labels,
		Arch:       arch,
	}, nil
}

// DebianRoot is where the agent image for linux/arch takes Debian's
// iptables tools from, and their version: / for this machine's own
// architecture; for another, the packages of that architecture unpacked by
// hack/debian-root.sh of the repository in repoDir (a private apt state,
// cached; it pins the version installed here).
func DebianRoot(ctx context.Context, repoDir, arch string) (root, iptablesVersion string, err error) {
	if arch == runtime.GOARCH {
		return "/", debianVersion(ctx, "iptables"), nil
	}
	script := filepath.Join(repoDir, "hack", "debian-root.sh")
	cmd := exec.CommandContext(ctx, script, arch)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", "", fmt.Errorf("release: Debian's %s packages for the agent image: %s: %v: %s", arch, script, err, stderr.String())
	}
	dir := strings.TrimSpace(string(out))
	v, err := os.ReadFile(filepath.Join(dir, "iptables.version"))
	if err != nil {
		return "", "", fmt.Errorf("release: %s: %w", script, err)
	}
	return filepath.Join(dir, "root"), strings.TrimSpace(string(v)), nil
}

// Controller is the inpod-controller image (taint mode): the static binary
// alone. It talks only to the API server, through the in-cluster service
// account (whose CA the pod mounts), so it needs no CA bundle or shell; the
// chart runs it as a non-root user with a read-only root filesystem.
func Controller(ctx context.Context, repoDir, tag, arch string) (Spec, error) {
	data, err := GoBinaryFor(ctx, repoDir, "./cmd/inpod-controller", arch)
	if err != nil {
		return Spec{}, err
	}
	return Spec{
		Ref:        ControllerRepository + ":" + tag,
		Files:      []File{{Path: ControllerBinary, Mode: 0o755, Data: data}},
		Entrypoint: []string{ControllerBinary},
		Arch:       arch,
		Labels: map[string]string{
			"org.opencontainers.image.title":       "inpod-controller",
			"org.opencontainers.image.description": "inpod-controller: removes the startup taint from nodes whose inpod agent is ready (taint mode)",
			"org.opencontainers.image.source":      "https://github.com/inpod-dev/inpod",
		},
	}, nil
}

// WaitReadyUser is the uid:gid the inpod-waitready image runs as: not root,
// so a pod's runAsNonRoot holds even without a runAsUser of its own.
const WaitReadyUser = "65532:65532"

// WaitReady is the inpod-waitready image (chart gate value initcontainer):
// the static check binary alone, a few MiB, as a non-root user. An image of
// its own rather than a mode of the agent image: it runs in every enrolled
// pod, so it carries nothing else (no iptables tools, no agent), and on a
// node where inpod is not installed yet (the case it exists for) it is
// pulled in a moment instead of the agent's larger image.
func WaitReady(ctx context.Context, repoDir, tag, arch string) (Spec, error) {
	data, err := GoBinaryFor(ctx, repoDir, "./cmd/inpod-waitready", arch)
	if err != nil {
		return Spec{}, err
	}
	return Spec{
		Ref:        WaitReadyRepository + ":" + tag,
		Files:      []File{{Path: WaitReadyBinary, Mode: 0o755, Data: data}},
		Entrypoint: []string{WaitReadyBinary},
		User:       WaitReadyUser,
		Arch:       arch,
		Labels: map[string]string{
			"org.opencontainers.image.title":       "inpod-waitready",
			"org.opencontainers.image.description": "inpod's init container: waits, unprivileged, until redirection to ztunnel is in place in the pod's network namespace",
			"org.opencontainers.image.source":      "https://github.com/inpod-dev/inpod",
		},
	}, nil
}

// debianVersion is the installed version of a Debian package, or "".
func debianVersion(ctx context.Context, pkg string) string {
	out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f", "${Version}", pkg).Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// Shipped is one image inpod ships.
type Shipped struct {
	// Name is the image's name, its repository's last element and its
	// tarball's name (<Name>.tar).
	Name string
	// Repository is the chart's default for it.
	Repository string
	// Values is where the chart takes it: <Values>.image.repository,
	// .tag and .digest.
	Values string
	// Build gives the image for linux/arch of the repository in repoDir,
	// tagged tag.
	Build func(ctx context.Context, repoDir, tag, arch string) (Spec, error)
}

// ShippedImages are the images inpod ships, in the order they are built.
func ShippedImages() []Shipped {
	return []Shipped{
		{Name: "inpod-agent", Repository: AgentRepository, Values: "agent", Build: Agent},
		{Name: "inpod-controller", Repository: ControllerRepository, Values: "controller", Build: Controller},
		{Name: "inpod-waitready", Repository: WaitReadyRepository, Values: "initContainer", Build: WaitReady},
	}
}

// Built is an image tarball written.
type Built struct {
	Shipped
	// Tag is the tag the tarball carries.
	Tag string
	// File is the tarball's path.
	File string
	// Digest is the image index's digest: the one a registry gives it
	// once pushed, and the one the chart pins.
	Digest v1.Hash
	// Archs are the platforms in the index (linux/<arch>).
	Archs []string
}

// Ref is the image's reference by tag.
func (b Built) Ref() string { return b.Repository + ":" + b.Tag }

// BuildImages builds every shipped image from the repository in repoDir,
// tagged tag, for linux/<arch> of each of archs (nil: Platforms) into
// outDir as <name>.tar (an OCI image index in an OCI layout tarball,
// WriteIndex), in ShippedImages' order.
func BuildImages(ctx context.Context, repoDir, tag, outDir string, archs []string) ([]Built, error) {
	if archs == nil {
		archs = Platforms
	}
	for _, s := range ShippedImages() {
		if _, err := name.NewTag(s.Repository + ":" + tag); err != nil {
			return nil, fmt.Errorf("release: tag %q: %w", tag, err)
		}
	}
	var out []Built
	for _, s := range ShippedImages() {
		var specs []Spec
		for _, arch := range archs {
			spec, err := s.Build(ctx, repoDir, tag, arch)
			if err != nil {
				return nil, err
			}
			specs = append(specs, spec)
		}
		file := filepath.Join(outDir, s.Name+".tar")
		d, err := WriteIndex(s.Repository+":"+tag, specs, file)
		if err != nil {
			return nil, err
		}
		out = append(out, Built{Shipped: s, Tag: tag, File: file, Digest: d, Archs: archs})
	}
	return out, nil
}
