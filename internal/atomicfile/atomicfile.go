// Package atomicfile replaces files so that no reader ever sees one half
// written: the CNI runtime reading a conflist, the plugin reading its pass
// list or API access file, a runtime exec'ing a plugin binary.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// TempPrefix starts the name of every temporary file Write makes, so that
// watchers can ignore them. The rest of the name ends in random digits: no
// CNI extension, so no runtime loads one as a network.
const TempPrefix = ".inpod-tmp-"

// IsTemp reports whether path is one of Write's temporary files.
func IsTemp(path string) bool { return strings.HasPrefix(filepath.Base(path), TempPrefix) }

// Write writes data to a temporary file beside path, syncs it, and renames
// it into place with the given mode.
func Write(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), TempPrefix+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("replace %s: %w", path, err)
	}
	return nil
}
