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
