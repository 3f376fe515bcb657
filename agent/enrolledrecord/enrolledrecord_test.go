package enrolledrecord

import (
	"net/netip"
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
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("directory %v (%v), want mode 0700: the record is the agent's alone", fi, err)
	}
	const a, b = "0b7d8c2e-5f4a-4c1e-9a0b-1c2d3e4f5a6b", "u2"
	for _, uid := range []string{a, b, a} {
		if err := d.Record(uid, nil); err != nil {
			t.Fatalf("record %s: %v", uid, err)
		}
	}
	if !recorded(t, d, a) || !recorded(t, d, b) || recorded(t, d, "u3") {
		t.Fatalf("recorded: %s %v, %s %v, u3 %v", a, recorded(t, d, a), b, recorded(t, d, b), recorded(t, d, "u3"))
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
	if recorded(t, d, a) || !recorded(t, d, b) {
		t.Fatal("Forget removed the wrong record")
	}
	// Reopened, as by the next agent: the records are still there.
	again, err := Open(dir)
	if err != nil || !recorded(t, again, b) {
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
		if err := d.Record(uid, nil); err == nil {
			t.Errorf("Record(%q) succeeded", uid)
		}
		if err := d.Forget(uid); err == nil {
			t.Errorf("Forget(%q) succeeded", uid)
		}
		if recorded(t, d, uid) {
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
	if recorded(t, d, "subdir") || recorded(t, d, "link") {
		t.Fatal("a directory or a symlink taken for a record")
	}
	if err := d.Record("link", nil); err == nil {
		t.Fatal("Record followed a symlink planted in the directory")
	}
	if got, _ := d.List(); len(got) != 0 {
		t.Fatalf("List = %v, want none", got)
	}
}

func recorded(t *testing.T, d *Dir, uid string) bool {
	t.Helper()
	ok, err := d.Recorded(uid)
	if err != nil {
		t.Fatalf("Recorded(%q): %v", uid, err)
	}
	return ok
}

// A directory left looser by someone else is made the agent's alone; a
// record that cannot be looked up is an error, not "no record".
func TestOpenTightensTheDirectoryAndLookupErrorsAreErrors(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "enrolled")
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("directory %v (%v), want mode 0700", fi, err)
	}
	// The directory replaced by a file: a lookup fails with ENOTDIR.
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if ok, err := d.Recorded("u1"); err == nil {
		t.Fatalf("Recorded with the directory replaced by a file = %v, nil; want an error", ok)
	}
	if err := d.Record("u1", nil); err == nil {
		t.Fatal("Record with the directory replaced by a file succeeded")
	}
}

// The record keeps the sandbox's IPs for the next agent; what the agent did
// not write whole reads as none, never as other IPs.
func TestRecordKeepsTheSandboxIPs(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	v4, v6 := netip.MustParseAddr("10.244.1.7"), netip.MustParseAddr("fd00:10:244::7")
	if err := d.Record("u1", []netip.Addr{v4, v6}); err != nil {
		t.Fatal(err)
	}
	if got := ipsOf(t, d, "u1"); !slices.Equal(got, []netip.Addr{v4, v6}) {
		t.Fatalf("IPs = %v, want [%s %s]", got, v4, v6)
	}
	// A new sandbox of the pod, recorded again: its IPs replace the old.
	if err := d.Record("u1", []netip.Addr{v6}); err != nil {
		t.Fatal(err)
	}
	if got := ipsOf(t, d, "u1"); !slices.Equal(got, []netip.Addr{v6}) {
		t.Fatalf("IPs after a second record = %v, want [%s]", got, v6)
	}
	for name, content := range map[string]string{
		"empty":     "", // a release before records held IPs
		"cut-short": "10.244.1.7\n10.24",
		"garbage":   "10.244.1.7\nnot-an-ip\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if !recorded(t, d, name) {
			t.Fatalf("%s: not a record", name)
		}
		if got := ipsOf(t, d, name); got != nil {
			t.Errorf("%s record: IPs = %v, want none", name, got)
		}
	}
	if got := ipsOf(t, d, "no-record"); got != nil {
		t.Fatalf("IPs of a pod with no record = %v", got)
	}
}

func ipsOf(t *testing.T, d *Dir, uid string) []netip.Addr {
	t.Helper()
	ips, err := d.IPs(uid)
	if err != nil {
		t.Fatalf("IPs(%q): %v", uid, err)
	}
	return ips
}
