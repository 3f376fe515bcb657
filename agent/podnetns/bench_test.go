package podnetns_test

import (
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// hostProcesses is how many extra processes the benchmark runs in the
// node's netns, on top of the machine's own: a node's daemons, kernel
// threads and host-network pods.
const hostProcesses = 200

// BenchmarkFind measures one procfs scan for a running pod's netns, the
// work behind the agent's sandbox checks (PreStartContainer, a status that
// says the sandbox may be new, the periodic sweep, restart), with the node's
// netns passed over before reading each process's cgroup against reading
// every process's cgroup (how Find scanned before), on this machine's procfs
// plus hostProcesses sleepers in the node's netns.
func BenchmarkFind(b *testing.B) {
	netnstest.RequireRoot(b)
	uid, ip := "8b3c4d5e-6f7a-4b8c-9d0e-1f2a3b4c5d6e", netip.MustParseAddr("198.51.100.40")
	runningPod(b, uid, ip)
	for range hostProcesses {
		sleeper(b, nil, "")
	}
	node, err := netns.IdentityOfPath("/proc/self/ns/net") // the benchmark enters no netns
	if err != nil {
		b.Fatal(err)
	}
	variants := []struct {
		name   string
		finder podnetns.Finder
		took   []time.Duration
	}{
		{name: "node netns passed over", finder: podnetns.Finder{NodeNetNS: node}},
		{name: "every cgroup read", finder: podnetns.Finder{}},
	}
	b.ResetTimer()
	for range b.N {
		for i := range variants {
			v := &variants[i]
			start := time.Now()
			f, err := v.finder.Find(uid, []netip.Addr{ip})
			v.took = append(v.took, time.Since(start))
			if err != nil {
				b.Fatalf("%s: %v", v.name, err)
			}
			f.Close()
		}
	}
	b.StopTimer()
	med := func(ds []time.Duration) float64 { return benchreport.Ms(benchreport.Percentile(ds, 50)) }
	fast, all := med(variants[0].took), med(variants[1].took)
	b.ReportMetric(fast, "find-ms")
	b.ReportMetric(all, "find-every-cgroup-ms")
	benchreport.Record(b, benchreport.Figure{Section: "Sandbox checks (procfs)",
		Name:  fmt.Sprintf("find a running pod's netns, node netns passed over (median; this machine + %d node processes)", hostProcesses),
		Value: fast, Unit: "ms", FloorName: "the same scan reading every process's cgroup", Floor: all})
}

// restorePods is how many running pods BenchmarkRestoreSearch finds.
const restorePods = 30

// BenchmarkRestoreSearch measures what an agent's restore spends finding
// every running pod's netns: one procfs snapshot and a search of it per pod
// (agent.restore) against a procfs scan per pod (how it searched before),
// with restorePods pods and hostProcesses node processes.
func BenchmarkRestoreSearch(b *testing.B) {
	netnstest.RequireRoot(b)
	type pod struct {
		uid string
		ip  netip.Addr
	}
	var pods []pod
	for i := range restorePods {
		p := pod{uid: fmt.Sprintf("5e6f7a8b-9c0d-4e1f-8a2b-%012d", i), ip: netip.AddrFrom4([4]byte{198, 51, 100, byte(100 + i)})}
		runningPod(b, p.uid, p.ip)
		pods = append(pods, p)
	}
	for range hostProcesses {
		sleeper(b, nil, "")
	}
	node, err := netns.IdentityOfPath("/proc/self/ns/net")
	if err != nil {
		b.Fatal(err)
	}
	finder := podnetns.Finder{NodeNetNS: node}
	findAll := func(find func(uid string, ips []netip.Addr) (*os.File, error)) {
		for _, p := range pods {
			f, err := find(p.uid, []netip.Addr{p.ip})
			if err != nil {
				b.Fatal(err)
			}
			f.Close()
		}
	}
	var snapshot, scans []time.Duration
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		snap, err := finder.Snapshot()
		if err != nil {
			b.Fatal(err)
		}
		findAll(snap.Find)
		snapshot = append(snapshot, time.Since(start))
		start = time.Now()
		findAll(finder.Find)
		scans = append(scans, time.Since(start))
	}
	b.StopTimer()
	med := func(ds []time.Duration) float64 { return benchreport.Ms(benchreport.Percentile(ds, 50)) }
	b.ReportMetric(med(snapshot), "snapshot-ms")
	b.ReportMetric(med(scans), "scans-ms")
	benchreport.Record(b, benchreport.Figure{Section: "Sandbox checks (procfs)",
		Name:  fmt.Sprintf("a restore's netns searches for %d running pods, one procfs snapshot (median; this machine + %d node processes)", restorePods, hostProcesses),
		Value: med(snapshot), Unit: "ms", FloorName: "a procfs scan per pod", Floor: med(scans)})
}
