package atomicfile_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/inpod-dev/inpod/internal/atomicfile"
)

func TestWriteReplacesWithModeAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "10-net.conflist")
	for _, content := range []string{"first", "second"} {
		if err := atomicfile.Write(path, []byte(content), 0o640); err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil || string(data) != content {
			t.Fatalf("content %q, %v; want %q", data, err, content)
		}
		if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o640 {
			t.Fatalf("mode %v, want 0640", fi.Mode().Perm())
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("dir holds %d files, want only the target", len(entries))
	}
	if atomicfile.IsTemp(path) || !atomicfile.IsTemp(filepath.Join(dir, atomicfile.TempPrefix+"10-net.conflist-123")) {
		t.Fatal("IsTemp misjudges names")
	}
	if err := atomicfile.Write(filepath.Join(dir, "missing", "f"), nil, 0o600); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}
