package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// clearLeftovers undoes what a killed earlier run left under root: its
// processes (by recorded pid), its mounts (deepest first), the bridge and
// CNI files of its node, and the directory itself.
func clearLeftovers(root string) error {
	if _, err := os.Stat(root); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := killRecorded(filepath.Join(root, "pids")); err != nil {
		return fmt.Errorf("cluster: stop leftover processes: %w", err)
	}
	killShims(root)
	if err := unmountUnder(root); err != nil {
		return err
	}
	removeNodeNetworking(root)
	if err := os.RemoveAll(root); err != nil {
		return fmt.Errorf("cluster: remove leftover state %s: %w", root, err)
	}
	return nil
}

// mountsUnder lists mount points at or below dir, deepest first.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	return out, s.Err()
}

func unmountUnder(dir string) error {
	mounts, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("cluster: unmount %s: %w", m, err)
		}
	}
	return nil
}

// unescapeMount decodes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c byte
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(c)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func splitLines(s string) []string { return strings.Split(strings.TrimRight(s, "\n"), "\n") }

// Cleanup removes everything a node under root left behind: processes,
// mounts, bridge, state. It is what `make cluster-down` runs, and safe to run
// when nothing is there.
func Cleanup(root string) error { return clearLeftovers(root) }

// cleanDevicePluginDir removes what this node's kubelet and plugins left in
// the fixed device-plugin dir (the whole /var/lib/kubelet when the node
// created it).
func (n *Node) cleanDevicePluginDir() {
	if n.createdKubeletDir {
		os.RemoveAll("/var/lib/kubelet")
		return
	}
	entries, _ := os.ReadDir(hostDevicePluginDir)
	for _, e := range entries {
		if e.Type()&os.ModeSocket != 0 || e.Name() == kubeletDeviceCheckpoint {
			os.Remove(filepath.Join(hostDevicePluginDir, e.Name()))
		}
	}
}

// sweepStaleNetns deletes the runtime netns (cni-…) that hold an address
// of the node's pod range but were left by a node that never stopped (a
// run killed mid-test): only one node runs on a machine at a time (its
// bridge name is fixed), so no running pod has such a netns yet, and a
// stale one holding a reused address made the tests read the wrong pod's
// rules. It returns the names it deleted.
func sweepStaleNetns() []string {
	cidr := netip.MustParsePrefix(PodCIDR)
	var swept []string
	for ns := range listNetns() {
		if !strings.HasPrefix(ns, "cni-") {
			continue
		}
		out, err := exec.Command("ip", "-n", ns, "-o", "addr", "show").Output()
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(out)) {
			if p, err := netip.ParsePrefix(f); err == nil && cidr.Contains(p.Addr()) {
				if exec.Command("ip", "netns", "del", ns).Run() == nil {
					swept = append(swept, ns)
				}
				break
			}
		}
	}
	return swept
}

// Stop deletes every pod (so the runtime tears down their sandboxes and
// the CNI releases their addresses), stops all processes, and removes every
// mount, netns, bridge and file the node created.
func (n *Node) Stop() error {
	if n.Client != nil && n.procs != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		n.deleteAllPods(ctx)
		cancel()
	}
	for i := len(n.procs) - 1; i >= 0; i-- {
		n.procs[i].stop(15 * time.Second)
	}
	n.procs = nil
	killShims(n.cfg.Root)
	var errs []string
	if err := unmountUnder(n.cfg.Root); err != nil {
		errs = append(errs, err.Error())
	}
	for ns := range listNetns() {
		if !n.netnsBefore[ns] && strings.HasPrefix(ns, "cni-") {
			exec.Command("ip", "netns", "del", ns).Run()
		}
	}
	removeNodeNetworking(n.cfg.Root)
	n.cleanDevicePluginDir()
	for t := range hostTables() {
		if !n.tablesBefore[t] {
			exec.Command("nft", append([]string{"delete", "table"}, strings.Fields(t)...)...).Run()
		}
	}
	if err := os.RemoveAll(n.cfg.Root); err != nil {
		errs = append(errs, err.Error())
	}
	if len(errs) > 0 {
		return fmt.Errorf("cluster: teardown: %s", strings.Join(errs, "; "))
	}
	return nil
}

func (n *Node) deleteAllPods(ctx context.Context) {
	nss, err := n.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	zero := int64(0)
	for _, ns := range nss.Items {
		n.Client.CoreV1().Pods(ns.Name).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
	}
	poll(60*time.Second, "pods gone", func() (bool, error) {
		pods, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		return err == nil && len(pods.Items) == 0, err
	})
}

// killShims stops containerd shims of this node: they run detached from
// containerd, and would otherwise keep its state dir busy.
func killShims(root string) {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if strings.Contains(string(cmdline), "containerd-shim") && strings.Contains(string(cmdline), root) {
			syscall.Kill(pid, syscall.SIGKILL)
			waitGone(pid, 5*time.Second)
		}
	}
}

// removeNodeNetworking deletes the node's bridge; its leases and config
// live under root and go with it.
func removeNodeNetworking(string) {
	exec.Command("ip", "link", "del", BridgeName).Run()
}

func listNetns() map[string]bool {
	out := map[string]bool{}
	entries, _ := os.ReadDir("/var/run/netns")
	for _, e := range entries {
		out[e.Name()] = true
	}
	return out
}

// hostTables lists the host netns' nf_tables tables as "family name".
func hostTables() map[string]bool {
	out := map[string]bool{}
	data, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(data), "\n") {
		if t, ok := strings.CutPrefix(strings.TrimSpace(line), "table "); ok {
			out[t] = true
		}
	}
	return out
}
