package images

import (
	"context"
	"path/filepath"
	"runtime"

	"github.com/inpod-dev/inpod/release"
)

// StandInRepository is the ztunnel-standin image's repository (a test
// peer's: never released).
const StandInRepository = "ghcr.io/inpod-dev/ztunnel-standin"

// StandInFile is the stand-in's tarball in the directory BuildForChart and
// WriteStandIn write to.
const StandInFile = "ztunnel-standin.tar"

// StandIn is the ztunnel-standin image: a test peer that plays ztunnel on
// the ZDS socket for the demo and the e2e tests. It is not a proxy.
func StandIn(ctx context.Context, repoDir, tag string) (release.Spec, error) {
	data, err := release.GoBinary(ctx, repoDir, "./cmd/ztunnel-standin")
	if err != nil {
		return release.Spec{}, err
	}
	return release.Spec{
		Ref:        StandInRepository + ":" + tag,
		Files:      []release.File{{Path: "/usr/local/bin/ztunnel-standin", Mode: 0o755, Data: data}},
		Entrypoint: []string{"/usr/local/bin/ztunnel-standin"},
		Labels: map[string]string{
			"org.opencontainers.image.title":       "ztunnel-standin",
			"org.opencontainers.image.description": "TEST PEER ONLY: plays Istio's ztunnel on the ZDS socket for inpod's demo and tests; proxies nothing",
			"org.opencontainers.image.source":      "https://github.com/inpod-dev/inpod",
		},
	}, nil
}

// WriteStandIn builds the stand-in image, tagged tag, into outDir as
// StandInFile and returns its path.
func WriteStandIn(ctx context.Context, repoDir, tag, outDir string) (string, error) {
	spec, err := StandIn(ctx, repoDir, tag)
	if err != nil {
		return "", err
	}
	out := filepath.Join(outDir, StandInFile)
	_, err = release.Write(spec, out)
	return out, err
}

// BuildForChart writes into outDir what the tests that install the chart
// import into their node: the shipped images (package release, as make
// release builds them: <name>.tar) and the stand-in (StandInFile).
func BuildForChart(ctx context.Context, repoDir, tag, outDir string) error {
	// The test node runs this machine's platform: the other platforms'
	// builds are the release tests' (and the e2e that installs from make
	// release's artifacts).
	if _, err := release.BuildImages(ctx, repoDir, tag, outDir, []string{runtime.GOARCH}); err != nil {
		return err
	}
	_, err := WriteStandIn(ctx, repoDir, tag, outDir)
	return err
}
