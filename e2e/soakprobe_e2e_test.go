//go:build e2e

package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// What the soak reads from outside inpod, without failing the test (it runs
// in goroutines and tolerates an API or a process that is down for a
// fault): the netns of every pod address, a netns's rules, the stand-in's
// record, the agent process's open files and the kubelet's log.

// netnsByIP maps every IPv4 address in a netns under /run/netns to that
// netns's name.
func netnsByIP() map[string]string {
	out := map[string]string{}
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return out
	}
	for _, e := range entries {
		b, err := exec.Command("ip", "-n", e.Name(), "-o", "-4", "addr", "show").Output()
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			for i := 0; i+1 < len(f); i++ {
				if f[i] == "inet" {
					ip, _, _ := strings.Cut(f[i+1], "/")
					out[ip] = e.Name()
				}
			}
		}
	}
	return out
}

// netnsRules is the netns's nf_tables ruleset (nft -a -s, as
// netnsRuleset) and its identity (dev:ino, as the stand-in records it).
func netnsRules(name string) (rules string, id string, err error) {
	ident, err := netns.IdentityOfPath(filepath.Join("/run/netns", name))
	if err != nil {
		return "", "", err
	}
	b, err := exec.Command("ip", "netns", "exec", name, "nft", "-a", "-s", "list", "ruleset").CombinedOutput()
	if err != nil {
		return "", "", fmt.Errorf("nft in %s: %v: %s", name, err, b)
	}
	return string(b), ident.String(), nil
}

// standinRecords reads every stand-in process's record under dir (one file
// per stand-in pod, appended by each of its container's runs).
func standinRecords(dir string) map[string][]ztunnel.RecordEntry {
	out := map[string][]ztunnel.RecordEntry{}
	files, _ := filepath.Glob(filepath.Join(dir, "*.jsonl"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var es []ztunnel.RecordEntry
		for _, line := range strings.Split(string(b), "\n") {
			var e ztunnel.RecordEntry
			if json.Unmarshal([]byte(line), &e) == nil {
				es = append(es, e)
			}
		}
		out[strings.TrimSuffix(filepath.Base(f), ".jsonl")] = es
	}
	return out
}

// ackedBefore reports whether any stand-in acknowledged an Add for uid in
// the netns id at or before t.
func ackedBefore(records map[string][]ztunnel.RecordEntry, uid, id string, t time.Time) bool {
	for _, es := range records {
		for _, e := range es {
			if e.Event == "ack" && e.UID == uid && e.NetNS == id && !e.Time.After(t) {
				return true
			}
		}
	}
	return false
}

// recordOf is every stand-in's record about uid, plus their starts and stops, in
// time order: what a violation report needs to be read without the files.
func recordOf(records map[string][]ztunnel.RecordEntry, uid string) string {
	type line struct {
		at   time.Time
		text string
	}
	var lines []line
	for standin, es := range records {
		for _, e := range es {
			if e.UID == uid || e.Event == "start" || e.Event == "stop" {
				lines = append(lines, line{e.Time, fmt.Sprintf("  %s %s %s %s %s", e.Time.UTC().Format("15:04:05.000000"), standin, e.Event, e.Pod, e.NetNS)})
			}
		}
	}
	slices.SortFunc(lines, func(a, b line) int { return a.at.Compare(b.at) })
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l.text + "\n")
	}
	return b.String()
}

// delBetween is the first time a stand-in closed uid's workload (a Del, or
// left out of a snapshot) within (from, to].
func delBetween(records map[string][]ztunnel.RecordEntry, uid string, from, to time.Time) (time.Time, bool) {
	var first time.Time
	for _, es := range records {
		for _, e := range es {
			if e.Event == "del" && e.UID == uid && e.Time.After(from) && !e.Time.After(to) && (first.IsZero() || e.Time.Before(first)) {
				first = e.Time
			}
		}
	}
	return first, !first.IsZero()
}

// firstAck is when a stand-in first acknowledged an Add for uid in the
// netns id (zero when none did).
func firstAck(records map[string][]ztunnel.RecordEntry, uid, id string) time.Time {
	var first time.Time
	for _, es := range records {
		for _, e := range es {
			if e.Event == "ack" && e.UID == uid && e.NetNS == id && (first.IsZero() || e.Time.Before(first)) {
				first = e.Time
			}
		}
	}
	return first
}

// holdingAck is the ack the app's start ran under: the last ack of uid in
// the netns id at or before appStart, else (the record written after the
// app's read, a known limit) the first one. Not simply the first: a netns
// inode number is reused at once, so a sandbox the runtime tore down (a
// kubelet restart mid-RunPodSandbox: its ADD acked, then its DEL) and the
// one created again for the pod show the same id, and the first sandbox's
// Del is no loss for an app that started under the second one's ack.
func holdingAck(records map[string][]ztunnel.RecordEntry, uid, id string, appStart time.Time) time.Time {
	var last time.Time
	for _, es := range records {
		for _, e := range es {
			if e.Event == "ack" && e.UID == uid && e.NetNS == id && !e.Time.After(appStart) && e.Time.After(last) {
				last = e.Time
			}
		}
	}
	if last.IsZero() {
		return firstAck(records, uid, id)
	}
	return last
}

// standinWorkloads replays one stand-in's record: its workloads now (uid →
// netns), from its last start.
func standinWorkloads(es []ztunnel.RecordEntry) map[string]string {
	ws := map[string]string{}
	for _, e := range es {
		switch e.Event {
		case "start", "stop":
			ws = map[string]string{}
		case "ack":
			ws[e.UID] = e.NetNS
		case "del":
			delete(ws, e.UID)
		}
	}
	return ws
}

// freezeProcs stops (SIGSTOP) every process of the node's containers whose
// comm is name, and returns them and what lets them run again (SIGCONT;
// safe to call more than once). A process it could not stop is resumed
// again before the error returns.
func freezeProcs(containerd, name string) (pids []int, resume func(), err error) {
	pids = containerProcs(containerd, name)
	resume = func() {
		for _, pid := range pids {
			unix.Kill(pid, unix.SIGCONT)
		}
	}
	if len(pids) == 0 {
		return nil, resume, fmt.Errorf("no %s process", name)
	}
	for _, pid := range pids {
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			resume()
			return nil, resume, fmt.Errorf("stop %s (pid %d): %w", name, pid, err)
		}
	}
	return pids, resume, nil
}

// containerProcs lists the pids of the node's running containers (their
// first process, as the node's containerd reports its tasks) whose comm is
// name: only this node's, never a process of the host's or another test's.
func containerProcs(containerd, name string) []int {
	b, err := exec.Command("ctr", "--address", containerd, "-n", "k8s.io", "tasks", "ls").Output()
	if err != nil {
		return nil
	}
	var out []int
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[2] != "RUNNING" {
			continue
		}
		pid, err := strconv.Atoi(f[1])
		if err != nil {
			continue
		}
		if c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(c)) == name {
			out = append(out, pid)
		}
	}
	return out
}

// fdCounts counts a process's open fds: all, sockets, and network
// namespaces (the agent holds a pod's netns only while it works on it).
type fdCounts struct{ fds, sockets, netns int }

func (c fdCounts) String() string {
	return fmt.Sprintf("fds=%d sockets=%d netns=%d", c.fds, c.sockets, c.netns)
}

func openFDs(pid int) (fdCounts, error) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fdCounts{}, err
	}
	var c fdCounts
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		c.fds++
		switch {
		case strings.HasPrefix(target, "socket:"):
			c.sockets++
		case strings.HasPrefix(target, "net:"):
			c.netns++
		}
	}
	return c, nil
}

// hostInpodObjects counts the nf_tables objects (tables, chains, sets,
// rules: everything with a handle) of inpod's own host table, and lists the
// addresses in its probe sets.
func hostInpodObjects() (objects int, members []string, err error) {
	b, err := exec.Command("nft", "-a", "list", "table", "inet", "inpod-host").CombinedOutput()
	if err != nil {
		if strings.Contains(string(b), "No such file") {
			return 0, nil, nil
		}
		return 0, nil, fmt.Errorf("nft list table inet inpod-host: %v: %s", err, b)
	}
	text := string(b)
	objects = strings.Count(text, "# handle ")
	for _, line := range strings.Split(text, "\n") {
		if _, els, ok := strings.Cut(line, "elements = {"); ok {
			els, _, _ = strings.Cut(els, "}")
			for _, m := range strings.Split(els, ",") {
				if m = strings.TrimSpace(m); m != "" {
					members = append(members, m)
				}
			}
		}
	}
	return objects, members, nil
}

// kubeletAdmissions are the times the kubelet first took each pod ("SyncLoop
// ADD", logged just before its admission checks) from its log, by ns/name.
// A kubelet restart logs every pod again; the first line counts.
func kubeletAdmissions(logPath string) (map[string]time.Time, error) {
	f, err := os.Open(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]time.Time{}
	year := time.Now().Year()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, `"SyncLoop ADD"`) || len(line) < 21 {
			continue
		}
		// klog: Lmmdd hh:mm:ss.uuuuuu
		ts, err := time.ParseInLocation("0102 15:04:05.000000", line[1:21], time.Local)
		if err != nil {
			continue
		}
		ts = ts.AddDate(year, 0, 0)
		_, pods, ok := strings.Cut(line, "pods=[")
		if !ok {
			continue
		}
		pods, _, _ = strings.Cut(pods, "]")
		for _, p := range strings.Split(pods, ",") {
			p = strings.Trim(strings.TrimSpace(p), `"`)
			if _, seen := out[p]; !seen && p != "" {
				out[p] = ts
			}
		}
	}
	return out, sc.Err()
}
