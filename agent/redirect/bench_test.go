package redirect_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/netns"
)

// freshNetNS creates an anonymous network namespace with loopback up; it
// lives as long as the returned fd.
func freshNetNS(b *testing.B) *os.File {
	errc := make(chan error, 1)
	var f *os.File
	go func() {
		// This thread ends up in the new namespace and is never unlocked,
		// so the runtime discards it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		var err error
		f, err = os.Open("/proc/thread-self/ns/net")
		errc <- err
	}()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(f.Fd())))
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err == nil {
		err = h.LinkSetUp(lo)
	}
	if err != nil {
		b.Fatal(err)
	}
	return f
}

// bareRestore is the floor: the engine's own rule text fed straight to
// iptables-restore and ip6tables-restore, nothing checked before or after.
func bareRestore(mode string) func(*os.File) error {
	return func(ns *os.File) error {
		return netns.Do(ns, func() error {
			for _, f := range []redirect.Family{redirect.IPv4, redirect.IPv6} {
				bin := "iptables-" + mode + "-restore"
				if f == redirect.IPv6 {
					bin = "ip6tables-" + mode + "-restore"
				}
				cmd := exec.Command(bin, "--noflush", "--wait")
				cmd.Stdin = bytes.NewReader([]byte(redirect.IPTablesRestoreInput(f, redirect.Options{})))
				if out, err := cmd.CombinedOutput(); err != nil {
					return fmt.Errorf("%s: %v: %s", bin, err, out)
				}
			}
			return nil
		})
	}
}

// BenchmarkApplyFreshPod measures what a new pod costs: apply into a fresh
// netns, each way in turn within one loop so that every way sees the same
// machine load, and reports medians and ratios to the bare restore of the
// same rules.
func BenchmarkApplyFreshPod(b *testing.B) {
	engineApply := func(backend redirect.Backend) func(*os.File) error {
		e := redirect.NewEngine(backend)
		return func(ns *os.File) error {
			_, err := e.Apply(ns, redirect.Options{})
			return err
		}
	}
	iptNFT, err := redirect.NewIPTables(redirect.IPTablesNFT)
	if err != nil {
		b.Fatal(err)
	}
	iptLegacy, err := redirect.NewIPTables(redirect.IPTablesLegacy)
	if err != nil {
		b.Fatal(err)
	}
	ways := []struct {
		name  string
		apply func(*os.File) error
	}{
		{"bare-restore-nft", bareRestore("nft")},
		{"iptables-nft", engineApply(iptNFT)},
		{"nftables", engineApply(redirect.NewNFTables())},
		{"bare-restore-legacy", bareRestore("legacy")},
		{"iptables-legacy", engineApply(iptLegacy)},
	}
	times := make([][]time.Duration, len(ways))
	b.ResetTimer()
	for range b.N {
		for i, w := range ways {
			b.StopTimer()
			ns := freshNetNS(b)
			b.StartTimer()
			start := time.Now()
			if err := w.apply(ns); err != nil {
				b.Fatalf("%s: %v", w.name, err)
			}
			times[i] = append(times[i], time.Since(start))
			b.StopTimer()
			ns.Close()
			b.StartTimer()
		}
	}
	b.StopTimer()
	median := func(i int) time.Duration { return benchreport.Percentile(times[i], 50) }
	for i, w := range ways {
		b.ReportMetric(float64(median(i).Microseconds())/1000, w.name+"-ms")
	}
	b.ReportMetric(float64(median(1))/float64(median(0)), "iptables-nft/bare-ratio")
	b.ReportMetric(float64(median(2))/float64(median(0)), "nftables/bare-ratio")
	b.ReportMetric(float64(median(4))/float64(median(3)), "iptables-legacy/bare-legacy-ratio")
	const section = "Rule apply into a fresh pod netns (median, IPv4 + IPv6)"
	for _, f := range []struct {
		name, floorName string
		i, floor        int
	}{
		{"iptables-nft backend", "bare iptables-nft-restore of the same rules", 1, 0},
		{"nftables backend (netlink)", "bare iptables-nft-restore of the same rules", 2, 0},
		{"iptables-legacy backend", "bare iptables-legacy-restore of the same rules", 4, 3},
	} {
		benchreport.Record(b, benchreport.Figure{Section: section, Name: f.name, Value: benchreport.Ms(median(f.i)), Unit: "ms",
			FloorName: f.floorName, Floor: benchreport.Ms(median(f.floor)), Target: "≤ 1.3× floor"})
	}
}
