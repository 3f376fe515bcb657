// Package podnetns finds the network namespace of a running pod from
// procfs, for pods the agent did not see through a CNI event: pods that were
// already running when the agent started, and pods whose labels enrolled
// them later.
package podnetns

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
)

// ErrNotFound means no process of the pod has a netns holding its IPs.
var ErrNotFound = errors.New("pod netns not found")

// Finder scans a procfs.
type Finder struct {
	// ProcRoot is the host's procfs (default /proc; /host/proc when the
	// agent runs in a container with the host's mounted there).
	ProcRoot string
	// NodeNetNS is the node's network namespace, identified once from
	// the agent's open handle on it (not through /proc/self, whose netns
	// is the main thread's, which a goroutine may have moved into a
	// pod's). Its processes are passed over before their cgroup is read:
	// an enrolled pod never runs on the node's network (rules there would
	// redirect the node), most of a node's processes do (kernel threads,
	// daemons, host-network pods), and reading a cgroup costs several
	// times the stat that tells the netns. Zero: every process counts.
	NodeNetNS netns.Identity
}

type candidate struct {
	pid   int
	start uint64
}

// Find returns the netns of the pod with the given UID: among the processes
// whose cgroup names the pod, outside the node's netns, the oldest whose
// network namespace has an interface holding one of ips. The caller owns
// the returned file.
//
// Both checks matter: the cgroup ties a process to the pod (a container
// process could otherwise claim any pod's IP), and the IP check ties the
// namespace to the pod's network (host-network containers of the same pod
// share the host's).
func (f Finder) Find(uid string, ips []netip.Addr) (*os.File, error) {
	if uid == "" || len(ips) == 0 {
		return nil, fmt.Errorf("podnetns: need the pod's uid and at least one IP")
	}
	needles := cgroupNeedles(uid)
	var cands []candidate
	err := f.walk(func(pid int, dir string) {
		if inPodCgroup(filepath.Join(dir, "cgroup"), needles) {
			cands = append(cands, candidate{pid: pid, start: startTime(filepath.Join(dir, "stat"))})
		}
	})
	if err != nil {
		return nil, err
	}
	return openHolding(f.root(), cands, needles, uid, ips)
}

func (f Finder) root() string {
	if f.ProcRoot == "" {
		return "/proc"
	}
	return f.ProcRoot
}

// cgroupNeedles are what a cgroup path of the pod's contains: its UID as
// the cgroupfs driver writes it, and as the systemd driver does.
func cgroupNeedles(uid string) []string {
	return []string{"pod" + uid, "pod" + strings.ReplaceAll(uid, "-", "_")}
}

// walk calls visit for each process outside the node's netns.
func (f Finder) walk(visit func(pid int, dir string)) error {
	root := f.root()
	entries, err := os.ReadDir(root)
	if err != nil {
		return fmt.Errorf("podnetns: read %s: %w", root, err)
	}
	skipNode := f.NodeNetNS != (netns.Identity{})
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join(root, e.Name())
		if skipNode {
			// A process whose netns cannot be stat'ed (gone, or not
			// ours to inspect) could not be opened below either.
			if id, err := netns.IdentityOfPath(filepath.Join(dir, "ns", "net")); err != nil || id == f.NodeNetNS {
				continue
			}
		}
		visit(pid, dir)
	}
	return nil
}

// openHolding opens the netns of the oldest candidate that holds one of
// ips. The candidate's cgroup is read again once its netns is open: a
// process that exited since it was read and whose PID was reused is not
// the pod's (a snapshot's candidates may be seconds old).
func openHolding(root string, cands []candidate, needles []string, uid string, ips []netip.Addr) (*os.File, error) {
	slices.SortFunc(cands, func(a, b candidate) int { return cmp.Compare(a.start, b.start) })
	for _, c := range cands {
		dir := filepath.Join(root, strconv.Itoa(c.pid))
		f, err := netns.Open(filepath.Join(dir, "ns", "net"))
		if err != nil {
			continue // the process exited meanwhile
		}
		if !inPodCgroup(filepath.Join(dir, "cgroup"), needles) {
			f.Close()
			continue
		}
		if HoldsAny(f, ips) {
			return f, nil
		}
		f.Close()
	}
	return nil, fmt.Errorf("%w: pod %s (%d processes in its cgroups, none in a netns holding %v)", ErrNotFound, uid, len(cands), ips)
}

// Snapshot is one pass over procfs for many searches in a row: an agent's
// restore looks for every pod of the node, and a Find per pod reads every
// process's cgroup again (70 pods took 6.5 s on a busy 2-CPU node). What
// it holds can go stale: a process gone since is passed over, and a pod
// whose processes started since is not found (the caller retries with a
// Finder).
type Snapshot struct {
	root  string
	procs []snapshotProcess
}

type snapshotProcess struct {
	pid    int
	dir    string
	cgroup string
}

// maxCgroupFile bounds what a snapshot keeps of a process's cgroup file.
const maxCgroupFile = 64 << 10

// Snapshot reads the cgroup of every process outside the node's netns.
func (f Finder) Snapshot() (*Snapshot, error) {
	s := &Snapshot{root: f.root()}
	err := f.walk(func(pid int, dir string) {
		file, err := os.Open(filepath.Join(dir, "cgroup"))
		if err != nil {
			return
		}
		defer file.Close()
		data, err := io.ReadAll(io.LimitReader(file, maxCgroupFile))
		if err != nil {
			return
		}
		s.procs = append(s.procs, snapshotProcess{pid: pid, dir: dir, cgroup: string(data)})
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Find is Finder.Find among the processes of the snapshot.
func (s *Snapshot) Find(uid string, ips []netip.Addr) (*os.File, error) {
	if uid == "" || len(ips) == 0 {
		return nil, fmt.Errorf("podnetns: need the pod's uid and at least one IP")
	}
	needles := cgroupNeedles(uid)
	var cands []candidate
	for _, p := range s.procs {
		if slices.ContainsFunc(needles, func(n string) bool { return strings.Contains(p.cgroup, n) }) {
			cands = append(cands, candidate{pid: p.pid, start: startTime(filepath.Join(p.dir, "stat"))})
		}
	}
	return openHolding(s.root, cands, needles, uid, ips)
}

// Holds is HoldsAny.
func (*Snapshot) Holds(ns *os.File, ips []netip.Addr) bool { return HoldsAny(ns, ips) }

func inPodCgroup(path string, needles []string) bool {
	file, err := os.Open(path)
	if err != nil {
		return false
	}
	defer file.Close()
	s := bufio.NewScanner(file)
	for s.Scan() {
		for _, n := range needles {
			if strings.Contains(s.Text(), n) {
				return true
			}
		}
	}
	return false
}

// startTime is field 22 of /proc/<pid>/stat, in clock ticks since boot.
func startTime(path string) uint64 {
	data, err := os.ReadFile(path)
	if err != nil {
		return ^uint64(0)
	}
	// The command name may contain spaces; fields count from after it.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		return ^uint64(0)
	}
	fields := strings.Fields(string(data[i+1:]))
	if len(fields) < 20 {
		return ^uint64(0)
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return ^uint64(0)
	}
	return v
}

// Holds is HoldsAny, for callers that take a Finder.
func (Finder) Holds(ns *os.File, ips []netip.Addr) bool { return HoldsAny(ns, ips) }

// HoldsAny reports whether the netns ns has one of ips on an interface,
// read over netlink without entering it (only the socket is made there).
func HoldsAny(ns *os.File, ips []netip.Addr) bool {
	nl, err := netns.OpenNetlink(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return false
	}
	defer nl.Close()
	holds := false
	for attempt := 0; attempt < 3 && !holds; attempt++ {
		// struct ifaddrmsg of AF_UNSPEC: the addresses of every family.
		err = nl.Request(unix.RTM_GETADDR, unix.NLM_F_DUMP, make([]byte, unix.SizeofIfAddrmsg), func(typ uint16, msg []byte) {
			if holds || typ != unix.RTM_NEWADDR || len(msg) < unix.SizeofIfAddrmsg {
				return
			}
			ad, err := mnl.NewAttributeDecoder(msg[unix.SizeofIfAddrmsg:])
			if err != nil {
				return
			}
			// IFA_LOCAL is the interface's own address; IFA_ADDRESS is
			// the same, except on a point-to-point link, where it is the
			// peer's (which the netns does not hold).
			var local, address []byte
			for ad.Next() {
				switch ad.Type() {
				case unix.IFA_LOCAL:
					local = ad.Bytes()
				case unix.IFA_ADDRESS:
					address = ad.Bytes()
				}
			}
			if local == nil {
				local = address
			}
			if ip, ok := netip.AddrFromSlice(local); ok && slices.Contains(ips, ip.Unmap()) {
				holds = true
			}
		})
		// An address seen is held, interrupted dump or not; an
		// interrupted dump that saw none is asked again.
		if !errors.Is(err, netns.ErrDumpInterrupted) {
			break
		}
	}
	return holds
}
