// Package plugintest builds the plugin's binaries for tests the way
// `make build` ships them: static (no cgo, whose dynamic loader alone would
// add about a millisecond to every exec) and stripped.
package plugintest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Packages are the binaries the agent installs into the CNI bin dir.
var Packages = []string{
	"github.com/inpod-dev/inpod/cmd/inpod-cni",
	"github.com/inpod-dev/inpod/cmd/inpod-cni-apicheck",
}

// Build builds inpod-cni and inpod-cni-apicheck into dir.
func Build(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	args := append([]string{"build", "-trimpath", "-ldflags=-s -w", "-o", dir + string(filepath.Separator)}, Packages...)
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build the plugin binaries: %v: %s", err, out)
	}
	return nil
}

// EchoPackage is the exec floor of a chained CNI plugin: a Go program that
// only reads its config and prints prevResult back.
const EchoPackage = "github.com/inpod-dev/inpod/plugin/testdata/echo"

// BuildEcho builds the echo plugin into dir, static and stripped like the
// real plugin so that the two execs compare, and returns its path. The
// plugin benchmark and the agent's burst-enrollment floor both exec it.
func BuildEcho(dir string) (string, error) {
	bin := filepath.Join(dir, "echo")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, EchoPackage)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the echo plugin: %v: %s", err, out)
	}
	return bin, nil
}
