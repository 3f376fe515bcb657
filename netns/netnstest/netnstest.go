// Package netnstest creates real, named network namespaces for tests with
// iproute2 and deletes them when the test ends, whether it passed or not.
package netnstest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// NetNS is a named namespace created by `ip netns add`.
type NetNS struct {
	Name string
	Path string
}

// RequireRoot skips t when the process cannot create namespaces, naming why.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2 (ip): " + err.Error())
	}
}

// New creates a namespace with loopback up and removes it at cleanup.
func New(t testing.TB) *NetNS {
	t.Helper()
	RequireRoot(t)
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	name := "inpodtest-" + hex.EncodeToString(b[:])
	Run(t, "ip", "netns", "add", name)
	n := &NetNS{Name: name, Path: filepath.Join("/var/run/netns", name)}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
	n.Exec(t, "ip", "link", "set", "lo", "up")
	return n
}

// Open opens the namespace fd and closes it at cleanup.
func (n *NetNS) Open(t testing.TB) *os.File {
	t.Helper()
	f, err := os.Open(n.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// Exec runs a command inside the namespace and returns its combined output.
func (n *NetNS) Exec(t testing.TB, args ...string) string {
	t.Helper()
	return Run(t, append([]string{"ip", "netns", "exec", n.Name}, args...)...)
}

// Run runs a command and fails the test with its output when it fails.
func Run(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}
