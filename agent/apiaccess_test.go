package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/plugin/apicheck"
)

func TestAPIAccessFollowsTheRotatedToken(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte("first\n"), 0o600)
	w := apiAccess{
		rest: &rest.Config{Host: "https://10.0.0.1:6443", BearerToken: "first", BearerTokenFile: tokenFile,
			TLSClientConfig: rest.TLSClientConfig{CAData: []byte("-----BEGIN CERTIFICATE-----\n")}},
		path:  filepath.Join(dir, "net.d", apiAccessFile),
		label: "mesh.example.com/mode",
	}
	token := func() string {
		t.Helper()
		// What inpod-cni-apicheck reads: the contract between the two.
		a, err := apicheck.ReadAccess(w.path)
		if err != nil {
			t.Fatal(err)
		}
		if a.Server != "https://10.0.0.1:6443" || !strings.Contains(string(a.CAData), "CERTIFICATE") || a.EnrollmentLabel != "mesh.example.com/mode" {
			t.Fatalf("access file: %+v", a)
		}
		return a.Token
	}
	if changed, err := w.write(); err != nil || !changed {
		t.Fatalf("first write: %v %v", changed, err)
	}
	if fi, _ := os.Stat(w.path); fi.Mode().Perm() != 0o600 {
		t.Fatalf("access file mode %v, want 0600", fi.Mode().Perm())
	}
	if got := token(); got != "first" {
		t.Fatalf("token %q", got)
	}
	if changed, err := w.write(); err != nil || changed {
		t.Fatalf("rewrite without a change: %v %v", changed, err)
	}
	// The kubelet rotates the projected token in place.
	os.WriteFile(tokenFile, []byte("second\n"), 0o600)
	if changed, err := w.write(); err != nil || !changed {
		t.Fatalf("write after rotation: %v %v", changed, err)
	}
	if got := token(); got != "second" {
		t.Fatalf("token after rotation %q, want the rotated one", got)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(dir, "net.d", ".inpod-tmp-*")); len(leftovers) > 0 {
		t.Fatalf("temporary files left: %v", leftovers)
	}
}

func TestAPIAccessNeedsAToken(t *testing.T) {
	w := apiAccess{rest: &rest.Config{Host: "https://10.0.0.1"}, path: filepath.Join(t.TempDir(), apiAccessFile)}
	if _, err := w.write(); err == nil || !strings.Contains(err.Error(), "bearer token") {
		t.Fatalf("write without a token: %v", err)
	}
	if _, err := os.Stat(w.path); !os.IsNotExist(err) {
		t.Fatal("an access file was written without a token")
	}
}
