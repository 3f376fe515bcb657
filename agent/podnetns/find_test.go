package podnetns_test

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// podCgroup makes a cgroup named like the kubelet's (cgroupfs driver) and
// removes it at cleanup.
func podCgroup(t testing.TB, uid string) string {
	t.Helper()
	dir := filepath.Join("/sys/fs/cgroup/pids", "inpod-test-kubepods", "besteffort", "pod"+uid)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Skipf("needs a writable cgroup v1 pids hierarchy: %v", err)
	}
	t.Cleanup(func() {
		os.Remove(dir)
		os.Remove(filepath.Dir(dir))
		os.Remove(filepath.Dir(filepath.Dir(dir)))
	})
	return dir
}

// sleeper starts a process inside ns (or the host netns when ns is nil),
// optionally in a cgroup, and kills it at cleanup.
func sleeper(t testing.TB, ns *netnstest.NetNS, cgroup string) int {
	t.Helper()
	args := []string{"sleep", "300"}
	if ns != nil {
		args = append([]string{"ip", "netns", "exec", ns.Name}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if ns != nil {
		// ip netns exec enters the netns after the fork: until then the
		// process is in the test's.
		want, err := netns.IdentityOfPath(ns.Path)
		if err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 10*time.Second, "the sleeper in its netns", func() bool {
			got, err := netns.IdentityOfPath(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
			return err == nil && got == want
		})
	}
	if cgroup != "" {
		if err := os.WriteFile(filepath.Join(cgroup, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return cmd.Process.Pid
}

// finder is what Finder and Snapshot both answer.
type finder interface {
	Find(uid string, ips []netip.Addr) (*os.File, error)
}

// finders are the two ways to search: a procfs scan per search, and one
// snapshot of procfs taken for many.
var finders = map[string]func(t *testing.T) finder{
	"scan": func(*testing.T) finder { return podnetns.Finder{} },
	"snapshot": func(t *testing.T) finder {
		s, err := podnetns.Finder{}.Snapshot()
		if err != nil {
			t.Fatal(err)
		}
		return s
	},
}

// runningPod is a pod's sandbox as procfs shows it: a netns holding ip, and
// a process in it under the pod's cgroup.
func runningPod(tb testing.TB, uid string, ip netip.Addr) (ns *netnstest.NetNS, cgroup string, pid int) {
	tb.Helper()
	cgroup = podCgroup(tb, uid)
	ns = netnstest.New(tb)
	ns.Exec(tb, "ip", "addr", "add", ip.String()+"/32", "dev", "lo")
	return ns, cgroup, sleeper(tb, ns, cgroup)
}

func TestFindMatchesCgroupAndIP(t *testing.T) {
	netnstest.RequireRoot(t)
	uid := "6f1c2d3e-4a5b-4c6d-8e7f-0a1b2c3d4e5f"
	cg := podCgroup(t, uid)
	pod, other := netnstest.New(t), netnstest.New(t)
	pod.Exec(t, "ip", "addr", "add", "198.51.100.20/32", "dev", "lo")
	// A decoy outside the pod's cgroup claims the same IP.
	other.Exec(t, "ip", "addr", "add", "198.51.100.20/32", "dev", "lo")
	sleeper(t, other, "")
	// A host-network process of the pod does not hold the IP.
	sleeper(t, nil, cg)
	sleeper(t, pod, cg)

	for name, finder := range finders {
		t.Run(name, func(t *testing.T) {
			finder := finder(t)
			f, err := finder.Find(uid, []netip.Addr{netip.MustParseAddr("198.51.100.20")})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			got, _ := netns.IdentityOf(int(f.Fd()))
			want, _ := netns.IdentityOfPath(pod.Path)
			if got != want {
				t.Fatalf("found netns %v, want the pod's %v", got, want)
			}

			_, err = finder.Find(uid, []netip.Addr{netip.MustParseAddr("198.51.100.21")})
			if !errors.Is(err, podnetns.ErrNotFound) {
				t.Fatalf("Find with an IP the pod lacks = %v, want ErrNotFound", err)
			}
			_, err = finder.Find("00000000-0000-0000-0000-000000000000", []netip.Addr{netip.MustParseAddr("198.51.100.20")})
			if !errors.Is(err, podnetns.ErrNotFound) {
				t.Fatalf("Find for another uid = %v, want ErrNotFound", err)
			}
		})
	}
}

// A snapshot is read once: a process that left the pod's cgroup since (as
// one whose PID was reused by another process would appear) is not taken
// for the pod's, and one started since is not found.
func TestSnapshotChecksItsCandidatesAgain(t *testing.T) {
	netnstest.RequireRoot(t)
	uid, ip := "9c4d5e6f-7a8b-4c9d-8e0f-2a3b4c5d6e7f", netip.MustParseAddr("198.51.100.40")
	pod, cg, pid := runningPod(t, uid, ip)
	snap, err := podnetns.Finder{}.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	// Out of the pod's cgroup, into its parent's.
	if err := os.WriteFile(filepath.Join(filepath.Dir(cg), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	if f, err := snap.Find(uid, []netip.Addr{ip}); !errors.Is(err, podnetns.ErrNotFound) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("Find of a process no longer in the pod's cgroup = %v, want ErrNotFound", err)
	}
	sleeper(t, pod, cg)
	if f, err := snap.Find(uid, []netip.Addr{ip}); !errors.Is(err, podnetns.ErrNotFound) {
		if f != nil {
			f.Close()
		}
		t.Fatalf("Find of a process started after the snapshot = %v, want ErrNotFound", err)
	}
	f, err := podnetns.Finder{}.Find(uid, []netip.Addr{ip})
	if err != nil {
		t.Fatalf("a scan does not find the process started after the snapshot: %v", err)
	}
	f.Close()
}

// A process of the pod in the node's netns is never the answer, even when
// that netns holds the pod's IP: rules installed there would redirect the
// node. (The node here is a netns of the test's, standing in for the real
// one.)
func TestFindPassesOverTheNodesNetns(t *testing.T) {
	netnstest.RequireRoot(t)
	uid := "7a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
	cg := podCgroup(t, uid)
	node, pod := netnstest.New(t), netnstest.New(t)
	both, nodeOnly := netip.MustParseAddr("198.51.100.30"), netip.MustParseAddr("198.51.100.31")
	node.Exec(t, "ip", "addr", "add", both.String()+"/32", "dev", "lo")
	node.Exec(t, "ip", "addr", "add", nodeOnly.String()+"/32", "dev", "lo")
	pod.Exec(t, "ip", "addr", "add", both.String()+"/32", "dev", "lo")
	sleeper(t, node, cg)
	sleeper(t, pod, cg)
	nodeID, _ := netns.IdentityOfPath(node.Path)
	podID, _ := netns.IdentityOfPath(pod.Path)
	finder := podnetns.Finder{NodeNetNS: nodeID}

	f, err := finder.Find(uid, []netip.Addr{both})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := netns.IdentityOf(int(f.Fd()))
	f.Close()
	if got != podID {
		t.Errorf("found netns %v, want the pod's %v (the node's is %v)", got, podID, nodeID)
	}

	// Only the node's netns holds the IP: without the node named, the
	// node is what a scan finds; with it, nothing is.
	f, err = podnetns.Finder{}.Find(uid, []netip.Addr{nodeOnly})
	if err != nil {
		t.Fatal(err)
	}
	got, _ = netns.IdentityOf(int(f.Fd()))
	f.Close()
	if got != nodeID {
		t.Fatalf("without NodeNetNS found %v, want the node's %v (the premise of this test)", got, nodeID)
	}
	if _, err := finder.Find(uid, []netip.Addr{nodeOnly}); !errors.Is(err, podnetns.ErrNotFound) {
		t.Fatalf("Find with only the node's netns holding the IP = %v, want ErrNotFound", err)
	}
}

// A netns holds the addresses of its interfaces, not the peers of its
// point-to-point links: a pod with such a link must not be taken for the
// pod whose IP is that peer.
func TestHoldsAnyCountsLocalAddressesNotPeers(t *testing.T) {
	ns := netnstest.New(t)
	ns.Exec(t, "ip", "link", "add", "p2p0", "type", "veth", "peer", "name", "p2p1")
	ns.Exec(t, "ip", "addr", "add", "192.0.2.1", "peer", "192.0.2.2", "dev", "p2p0")
	f := ns.Open(t)
	local, peer := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	if !podnetns.HoldsAny(f, []netip.Addr{local}) {
		t.Error("the netns's own address not found")
	}
	if podnetns.HoldsAny(f, []netip.Addr{peer}) {
		t.Error("the peer's address taken for the netns's own")
	}
}
