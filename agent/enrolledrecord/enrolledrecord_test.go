package enrolledrecord

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestRecordForgetAndList(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "enrolled")
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("directory mode %v (%v), want 0700: the record is the agent's alone", fi.Mode().Perm(), err)
	}
	const a, b = "0b7d8c2e-5f4a-4c1e-9a0b-1c2d3e4f5a6b", "u2"
	for _, uid := range []string{a, b, a} {
		if err := d.Record(uid); err != nil {
			t.Fatalf("record %s: %v", uid, err)
		}
	}
	if !d.Recorded(a) || !d.Recorded(b) || d.Recorded("u3") {
		t.Fatalf("recorded: %s %v, %s %v, u3 %v", a, d.Recorded(a), b, d.Recorded(b), d.Recorded("u3"))
	}
	got, err := d.List()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if !slices.Equal(got, []string{a, b}) {
		t.Fatalf("List = %v, want [%s %s]", got, a, b)
	}
	for _, uid := range []string{a, a, "u3"} {
		if err := d.Forget(uid); err != nil {
			t.Fatalf("forget %s: %v", uid, err)
		}
	}
	if d.Recorded(a) || !d.Recorded(b) {
		t.Fatal("Forget removed the wrong record")
	}
	// Reopened, as by the next agent: the records are still there.
	again, err := Open(dir)
	if err != nil || !again.Recorded(b) {
		t.Fatalf("the record did not outlive its writer: %v", err)
	}
	if err := again.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("directory still there after Remove: %v", err)
	}
}

// A UID names a file in the directory and nothing else: one that could
// leave it, or hide as a dot file, is refused, and a stray file that is not
// a record is not listed.
func TestUIDsThatCannotNameARecordAreRefused(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	long := make([]byte, 129)
	for i := range long {
		long[i] = 'a'
	}
	for _, uid := range []string{"", ".", "..", "../escape", "a/b", ".hidden", "sp ace", string(long)} {
		if err := d.Record(uid); err == nil {
			t.Errorf("Record(%q) succeeded", uid)
		}
		if err := d.Forget(uid); err == nil {
			t.Errorf("Forget(%q) succeeded", uid)
		}
		if d.Recorded(uid) {
			t.Errorf("Recorded(%q) = true", uid)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "escape")); !os.IsNotExist(err) {
		t.Fatal("a record was written outside the directory")
	}
	if err := os.Mkdir(filepath.Join(dir, "subdir"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/hostname", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if d.Recorded("subdir") || d.Recorded("link") {
		t.Fatal("a directory or a symlink taken for a record")
	}
	if err := d.Record("link"); err == nil {
		t.Fatal("Record followed a symlink planted in the directory")
	}
	if got, _ := d.List(); len(got) != 0 {
		t.Fatalf("List = %v, want none", got)
	}
}
