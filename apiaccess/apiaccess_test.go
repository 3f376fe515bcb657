package apiaccess_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/apiaccess"
)

func TestWriteThenReadIsTheContract(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "net.d", apiaccess.FileName)
	expires := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	in := &apiaccess.Access{Server: "https://10.0.0.1:6443", CAData: []byte("-----BEGIN CERTIFICATE-----\n"),
		Token: "first", Expires: expires, EnrollmentLabel: "mesh.example.com/mode"}
	if changed, err := apiaccess.Write(path, in); err != nil || !changed {
		t.Fatalf("first write: %v %v", changed, err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600: the file holds a token", fi.Mode().Perm())
	}
	out, err := apiaccess.Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if out.Server != in.Server || string(out.CAData) != string(in.CAData) || out.Token != "first" ||
		!out.Expires.Equal(expires) || out.EnrollmentLabel != in.EnrollmentLabel {
		t.Fatalf("read back %+v, want %+v", out, in)
	}
	if changed, err := apiaccess.Write(path, in); err != nil || changed {
		t.Fatalf("rewrite without a change: %v %v", changed, err)
	}
	in.Token = "second"
	if changed, err := apiaccess.Write(path, in); err != nil || !changed {
		t.Fatalf("write of a renewed token: %v %v", changed, err)
	}
	if out, _ := apiaccess.Read(path); out.Token != "second" {
		t.Fatalf("token %q after renewal", out.Token)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(dir, "net.d", ".inpod-tmp-*")); len(leftovers) > 0 {
		t.Fatalf("temporary files left: %v", leftovers)
	}
}

// An unknown expiry (a file written before the field existed) is no error.
func TestReadWithoutExpiry(t *testing.T) {
	path := filepath.Join(t.TempDir(), apiaccess.FileName)
	os.WriteFile(path, []byte(`{"server":"https://10.0.0.1","token":"t"}`), 0o600)
	a, err := apiaccess.Read(path)
	if err != nil || !a.Expires.IsZero() {
		t.Fatalf("Read = %+v, %v", a, err)
	}
}

func TestReadNamesTheBadField(t *testing.T) {
	dir := t.TempDir()
	cases := map[string]string{
		`{"server":"http://10.0.0.1","token":"t"}`: `"server"`,
		`{"server":"https://10.0.0.1"}`:            `"token"`,
		`{"server":`:                               "access.json",
	}
	for content, want := range cases {
		path := filepath.Join(dir, "access.json")
		os.WriteFile(path, []byte(content), 0o600)
		if _, err := apiaccess.Read(path); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Read(%s) = %v, want an error containing %s", content, err, want)
		}
	}
	if _, err := apiaccess.Read(filepath.Join(dir, "missing.json")); err == nil {
		t.Error("missing access file accepted")
	}
}

// The writer refuses what the reader would refuse, and leaves the old file.
func TestWriteRefusesAnUnusableAccess(t *testing.T) {
	path := filepath.Join(t.TempDir(), apiaccess.FileName)
	good := &apiaccess.Access{Server: "https://10.0.0.1", Token: "old"}
	if _, err := apiaccess.Write(path, good); err != nil {
		t.Fatal(err)
	}
	if _, err := apiaccess.Write(path, &apiaccess.Access{Server: "https://10.0.0.1"}); err == nil || !strings.Contains(err.Error(), "token") {
		t.Fatalf("write without a token: %v", err)
	}
	if a, err := apiaccess.Read(path); err != nil || a.Token != "old" {
		t.Fatalf("the old file was not kept: %+v, %v", a, err)
	}
}
