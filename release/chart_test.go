package release_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"go.yaml.in/yaml/v3"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/release"
)

func TestChartVersion(t *testing.T) {
	for tag, want := range map[string]string{
		"v1.2.3": "1.2.3", "0.1.0": "0.1.0", "v1.0.0-rc.1": "1.0.0-rc.1",
		"dev": "", "v1.2": "", "1.02.3": "", "v1.2.3+build": "", "latest": "",
	} {
		got, ok := release.ChartVersion(tag)
		if got != want || ok != (want != "") {
			t.Errorf("ChartVersion(%q) = %q, %v; want %q", tag, got, ok, want)
		}
	}
}

// fakeBuilt is what BuildImages returns, without building: digests made up.
func fakeBuilt(tag string) []release.Built {
	var out []release.Built
	for i, s := range release.ShippedImages() {
		out = append(out, release.Built{Shipped: s, Tag: tag, File: s.Name + ".tar",
			Digest: v1.Hash{Algorithm: "sha256", Hex: strings.Repeat(string(rune('a'+i)), 64)}})
	}
	return out
}

func TestValuesPinEveryImage(t *testing.T) {
	var vals map[string]struct {
		Image map[string]string `yaml:"image"`
	}
	if err := yaml.Unmarshal(release.Values(fakeBuilt("dev")), &vals); err != nil {
		t.Fatal(err)
	}
	for _, b := range fakeBuilt("dev") {
		got := vals[b.Values].Image
		tag, cleared := got["tag"]
		if len(got) != 2 || got["digest"] != b.Digest.String() || !cleared || tag != "" {
			t.Errorf("%s.image = %v, want digest %s and the tag cleared only (the repository stays the install's)", b.Values, got, b.Digest)
		}
	}
}

// TestPackagedChartPinsTheImages packages the chart twice (byte for byte
// the same archive, versioned from the tag) and renders it with the values
// file: every image of the chart, in every component it renders, is
// referenced by repository@digest.
func TestPackagedChartPinsTheImages(t *testing.T) {
	repo := testkit.RepoDir(t)
	helm := filepath.Join(repo, "bin", "helm")
	if _, err := os.Stat(helm); err != nil {
		t.Skip("needs bin/helm (make deps)")
	}
	ctx := context.Background()
	chart := filepath.Join(repo, "deploy", "helm", "inpod")
	dir := t.TempDir()
	// An earlier run's archive is replaced.
	if err := os.WriteFile(filepath.Join(dir, "inpod-0.0.1.tgz"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	first, err := release.PackageChart(ctx, helm, chart, "v1.2.3", dir)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(first) != "inpod-1.2.3.tgz" {
		t.Errorf("packaged %s, want inpod-1.2.3.tgz", first)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "inpod-*.tgz")); len(left) != 1 {
		t.Errorf("archives left: %v, want the new one only", left)
	}
	data, err := os.ReadFile(first)
	if err != nil {
		t.Fatal(err)
	}
	second, err := release.PackageChart(ctx, helm, chart, "v1.2.3", t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if again, err := os.ReadFile(second); err != nil || !bytes.Equal(data, again) {
		t.Errorf("the chart packaged twice differs (%v)", err)
	}

	vals := filepath.Join(dir, release.ValuesFile)
	if err := os.WriteFile(vals, release.Values(fakeBuilt("v1.2.3")), 0o644); err != nil {
		t.Fatal(err)
	}
	// Over an install by tag (helm upgrade --reuse-values -f): the old tags
	// come first, as the reused values do, and the file clears them.
	byTag := filepath.Join(dir, "by-tag.yaml")
	if err := os.WriteFile(byTag, []byte("agent: {image: {tag: v1.0.0}}\ncontroller: {image: {tag: v1.0.0}}\ninitContainer: {image: {tag: v1.0.0}}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(helm, "template", "x", first, "-f", byTag, "-f", vals, "--set", "gates={initcontainer}", "--set", "controller.enabled=true").CombinedOutput()
	if err != nil {
		t.Fatalf("helm template: %v: %s", err, out)
	}
	if !strings.Contains(string(out), "app.kubernetes.io/version: \"v1.2.3\"") || !strings.Contains(string(out), "helm.sh/chart: inpod-1.2.3") {
		t.Error("the packaged chart does not carry version 1.2.3 and appVersion v1.2.3")
	}
	refs := regexp.MustCompile(`image: "([^"]*)"`).FindAllStringSubmatch(string(out), -1)
	seen := map[string]bool{}
	for _, r := range refs {
		seen[r[1]] = true
	}
	for _, b := range fakeBuilt("v1.2.3") {
		if !seen[b.Repository+"@"+b.Digest.String()] {
			t.Errorf("no image %s@%s in the rendered chart", b.Repository, b.Digest)
		}
	}
	for ref := range seen {
		if !strings.Contains(ref, "@sha256:") {
			t.Errorf("image %s rendered by tag, not by digest", ref)
		}
	}
}
