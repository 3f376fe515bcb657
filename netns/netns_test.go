package netns_test

import (
	"errors"
	"net"
	"testing"

	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

func currentNetNS(t *testing.T) netns.Identity {
	t.Helper()
	id, err := netns.IdentityOfPath("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func TestDoRunsInsideAndLeavesCallerAlone(t *testing.T) {
	pod := netnstest.New(t)
	podFile := pod.Open(t)
	want, _ := netns.IdentityOf(int(podFile.Fd()))
	before := currentNetNS(t)

	var inside netns.Identity
	var ln net.Listener
	err := netns.Do(podFile, func() error {
		inside = currentNetNS(t)
		var err error
		ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if inside != want {
		t.Fatalf("fn ran in %v, want the pod's %v", inside, want)
	}
	// Many calls later, no goroutine of the caller lands in the pod netns.
	for range 50 {
		if got := currentNetNS(t); got != before {
			t.Fatalf("caller's thread moved to %v", got)
		}
	}
	// The listener lives in the pod netns: unreachable from here.
	if c, err := net.Dial("tcp4", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatal("socket created in the pod netns is reachable from the caller's netns")
	}
}

func TestDoPassesFnErrorThrough(t *testing.T) {
	pod := netnstest.New(t)
	sentinel := errors.New("sentinel")
	if err := netns.DoPath(pod.Path, func() error { return sentinel }); !errors.Is(err, sentinel) {
		t.Fatalf("err = %v", err)
	}
}

func TestCheckRejectsOtherFiles(t *testing.T) {
	for _, p := range []string{"/dev/null", "/proc/self/ns/mnt", "/proc/self/ns/uts"} {
		if _, err := netns.Open(p); !errors.Is(err, netns.ErrNotNetNS) {
			t.Errorf("Open(%s) = %v, want ErrNotNetNS", p, err)
		}
	}
	if _, err := netns.Open("/proc/self/ns/net"); err != nil {
		t.Errorf("Open(own netns): %v", err)
	}
	if _, err := netns.Open("/nonexistent/netns"); err == nil {
		t.Error("Open of a missing path succeeded")
	}
}
