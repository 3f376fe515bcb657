package release

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// ValuesFile is the name of the values file WriteValues writes.
const ValuesFile = "values-release.yaml"

// semver is a SemVer 2 version without build metadata (an image tag cannot
// carry '+'), with or without a leading v.
var semver = regexp.MustCompile(`^v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$`)

// ChartVersion is the chart version for a release tagged tag: the tag
// without its leading v when the tag is a semantic version, else ok is
// false and the chart keeps its own version.
func ChartVersion(tag string) (version string, ok bool) {
	if !semver.MatchString(tag) {
		return "", false
	}
	return strings.TrimPrefix(tag, "v"), true
}

// Values is a values file for the chart that pins every built image to its
// digest, so an install with it (helm install -f) runs
// exactly these images whatever the chart's tags. Each tag is cleared: the
// chart refuses a tag and a digest together, and an install by tag upgraded
// with --reuse-values -f values-release.yaml still carries its old tag. The
// repositories are left out: the chart's defaults are these, and an install
// from a mirror (--set <value>.image.repository) keeps its own on upgrade.
func Values(built []Built) []byte {
	var b bytes.Buffer
	b.WriteString("# The images of this release, pinned by digest (make release):\n")
	b.WriteString("# helm install -f " + ValuesFile + " runs exactly these. Images pushed to\n")
	b.WriteString("# another registry keep their digests: set <value>.image.repository.\n")
	for _, im := range built {
		fmt.Fprintf(&b, "%s:\n  image:\n    # built as %s\n    tag: \"\"\n    digest: %q\n", im.Values, im.Ref(), im.Digest.String())
	}
	return b.Bytes()
}

// PackageChart packages the chart in chartDir with helm into outDir, with
// --version and --app-version from tag when it is a semantic version
// (ChartVersion; the app version is the tag as is: the chart's default
// image tag). The archive is made reproducible: helm dates its entries at
// the moment it runs, PackageChart at the epoch. It replaces the archives
// of the same chart an earlier run left in outDir, and returns the path.
func PackageChart(ctx context.Context, helm, chartDir, tag, outDir string) (string, error) {
	meta, err := os.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return "", fmt.Errorf("release: chart: %w", err)
	}
	var chart struct {
		Name string `yaml:"name"`
	}
	if err := yaml.Unmarshal(meta, &chart); err != nil || chart.Name == "" {
		return "", fmt.Errorf("release: %s: no chart name (%v)", filepath.Join(chartDir, "Chart.yaml"), err)
	}
	tmp, err := os.MkdirTemp(outDir, ".chart-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	args := []string{"package", chartDir, "--destination", tmp}
	if v, ok := ChartVersion(tag); ok {
		args = append(args, "--version", v, "--app-version", tag)
	}
	if out, err := exec.CommandContext(ctx, helm, args...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("release: helm %s: %v: %s", strings.Join(args, " "), err, out)
	}
	made, err := filepath.Glob(filepath.Join(tmp, chart.Name+"-*.tgz"))
	if err != nil || len(made) != 1 {
		return "", fmt.Errorf("release: helm package wrote %v, want one %s-<version>.tgz", made, chart.Name)
	}
	data, err := reproducibleArchive(made[0])
	if err != nil {
		return "", err
	}
	old, err := filepath.Glob(filepath.Join(outDir, chart.Name+"-*.tgz"))
	if err != nil {
		return "", err
	}
	for _, o := range old {
		if err := os.Remove(o); err != nil {
			return "", err
		}
	}
	out := filepath.Join(outDir, filepath.Base(made[0]))
	return out, os.WriteFile(out, data, 0o644)
}

// reproducibleArchive is the chart archive at p with every entry dated at
// the epoch; everything else (entries, their order, the gzip header's
// Helm marks) as helm wrote it.
func reproducibleArchive(p string) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("release: %s: %w", p, err)
	}
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Header.Extra, zw.Header.Comment, zw.Header.Name = zr.Header.Extra, zr.Header.Comment, zr.Header.Name
	tr, tw := tar.NewReader(zr), tar.NewWriter(zw)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("release: %s: %w", p, err)
		}
		h.ModTime, h.AccessTime, h.ChangeTime = epoch, time.Time{}, time.Time{}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := io.Copy(tw, tr); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// FileDigest is the sha256 digest of a file's content, as sha256:<hex>.
func FileDigest(p string) (string, error) {
	data, err := os.ReadFile(p)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}
