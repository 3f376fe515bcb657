package images_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/inpod-dev/inpod/e2e/images"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// TestTestImagesAreReproducible builds the test images twice from the same
// tree: pause, testapp and the stand-in get the same digests, and the
// stand-in says it is a test peer.
func TestTestImagesAreReproducible(t *testing.T) {
	ctx := context.Background()
	repo := testkit.RepoDir(t)
	build := func() map[string]string {
		dir := t.TempDir()
		paths := map[string]string{}
		for _, img := range []images.Image{
			{Ref: images.PauseRef, Package: "./e2e/images/pause", Dir: repo},
			{Ref: images.TestAppRef, Package: "./e2e/images/testapp", Dir: repo},
		} {
			p, err := images.Build(ctx, img, dir)
			if err != nil {
				t.Fatal(err)
			}
			paths[img.Ref] = p
		}
		p, err := images.WriteStandIn(ctx, repo, "test", dir)
		if err != nil {
			t.Fatal(err)
		}
		paths[images.StandInRepository] = p
		digests := map[string]string{}
		for ref, p := range paths {
			img, err := tarball.ImageFromPath(p, nil)
			if err != nil {
				t.Fatal(err)
			}
			d, err := img.Digest()
			if err != nil {
				t.Fatal(err)
			}
			digests[ref] = d.String()
			if ref == images.StandInRepository {
				cf, err := img.ConfigFile()
				if err != nil {
					t.Fatal(err)
				}
				if desc := cf.Config.Labels["org.opencontainers.image.description"]; !strings.HasPrefix(desc, "TEST PEER ONLY") {
					t.Errorf("the stand-in's description %q does not say it is a test peer", desc)
				}
			}
		}
		return digests
	}
	first, second := build(), build()
	for ref, d := range first {
		if d != second[ref] {
			t.Errorf("%s: digest %s, then %s from the same tree", ref, d, second[ref])
		}
	}
}
