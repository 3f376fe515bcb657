package enroll_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/enrolledrecord"
	"github.com/inpod-dev/inpod/agent/podnetns"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// What the verifier costs the node (issue 35): its CPU at 250 enrolled pods
// as a share of one core at the default --verify-period of 10 s.
//
// The pieces are the ones the pipeline tests use, wired as the agent wires
// them: each pod a real netns with its IP on lo, enrolled through a CNI ADD,
// its rules read back from the kernel by the agent's engine (the backend in
// use plus the other backends' leftover check, as agent.otherBackends), a
// real ZDS server with a ztunnel stand-in that binds its three listeners in
// every pod, the host probe set in a scratch node netns, the procfs finder,
// the enrolled record on disk. Only the pod cache is a map.
//
// Every per-pod check the verifier makes goes through a timed wrapper that
// can also be switched off (it then answers "intact" at once), so one run
// measures, round after round in turn under the same load: the full round;
// the round with only the rules checked (the floor: what re-proving the
// rules alone costs: the nf_tables generation, and the read-back when it
// moved or every 5 minutes); and the round with no per-pod check (the
// verifier's own bookkeeping: pod locks, cache look-ups, settling each
// pod's proof; the generation answered from memory; and the probe set
// sync, once a round, which is not wrapped: its signature is not the same
// in every version of enroll.ProbeSet).
//
// CPU is getrusage user+sys of this process and of its waited-for children
// (the iptables backends exec iptables-save) around each round. The stand-in
// runs in this process and its share cannot be told apart; but a round that
// finds everything intact sends ztunnel nothing (Acked answers from memory,
// the listeners are read through sock_diag by the kernel), so the stand-in
// is idle during a round, and the process' idle CPU is logged as a control.

const (
	benchPods    = 250
	verifyPeriod = 10 * time.Second
)

type verifyMode int32

const (
	modeFull  verifyMode = iota // every check
	modeRules                   // the rules check alone: the nf_tables generation, read back when it moved
	modeEmpty                   // no per-pod check: bookkeeping, probe set sync
)

func (m verifyMode) String() string {
	return [...]string{"full round", "rules check only", "no per-pod check"}[m]
}

// stage is the wall time one check took over a round, and how often it ran.
type stage struct {
	n int
	d time.Duration
}

// run runs a check, timed into s and labelled for the CPU profile: the
// label follows the goroutines the check starts (netns.Do, the netlink
// libraries' netns switches), so `go tool pprof -tags` splits the CPU of
// a round by check.
func (s *stage) run(ctx context.Context, check string, fn func()) {
	start := time.Now()
	pprof.Do(ctx, pprof.Labels("check", check), func(context.Context) { fn() })
	s.n++
	s.d += time.Since(start)
}

// timedChecks is the state the wrappers share: the mode they run in, the
// engine the rules go through, and each check's time in the current round.
// VerifyAll runs its checks one after another, and nothing else calls them
// while it runs, so the stages need no lock.
type timedChecks struct {
	mode         atomic.Int32
	engine       atomic.Pointer[redirect.Engine]
	noGeneration atomic.Bool
	// generations are the pods' last nf_tables generations, by netns,
	// which a round with no per-pod check answers from.
	generations sync.Map
	opts        redirect.Options
	// labels carry the round's mode into the profile.
	labels context.Context

	sandbox, rules, acked, listeners stage
}

func (c *timedChecks) on(modes ...verifyMode) bool {
	m := verifyMode(c.mode.Load())
	for _, x := range modes {
		if m == x {
			return true
		}
	}
	return false
}

func (c *timedChecks) reset() {
	c.sandbox, c.rules, c.acked, c.listeners = stage{}, stage{}, stage{}, stage{}
}

type timedFinder struct {
	c *timedChecks
	podnetns.Finder
}

func (f timedFinder) Holds(ns *os.File, ips []netip.Addr) bool {
	if !f.c.on(modeFull) {
		return true
	}
	var holds bool
	f.c.sandbox.run(f.c.labels, "sandbox", func() { holds = f.Finder.Holds(ns, ips) })
	return holds
}

// generation is redirect.Generation, or (noGeneration) an error, which
// makes every round read the rules back in full, as it does with
// iptables-legacy and, every few minutes, with the other backends.
func (c *timedChecks) generation(ns *os.File) (uint32, error) {
	if c.noGeneration.Load() {
		return 0, errors.New("bench: no generation")
	}
	if c.on(modeEmpty) {
		if g, ok := c.generations.Load(ns); ok {
			return g.(uint32), nil
		}
	}
	g, err := redirect.Generation(ns)
	if err == nil {
		c.generations.Store(ns, g)
	}
	return g, err
}

type timedRules struct{ c *timedChecks }

func (r timedRules) Apply(ns *os.File, _ enroll.Variant) (bool, error) {
	if !r.c.on(modeFull, modeRules) {
		return false, nil
	}
	var res redirect.Result
	var err error
	r.c.rules.run(r.c.labels, "rules", func() { res, err = r.c.engine.Load().Apply(ns, r.c.opts) })
	return res.Changed, err
}

func (r timedRules) Remove(ns *os.File) (bool, error)  { return r.c.engine.Load().Remove(ns) }
func (r timedRules) Present(ns *os.File) (bool, error) { return r.c.engine.Load().Present(ns) }

type timedAcks struct {
	c   *timedChecks
	srv **zds.Server
}

func (a timedAcks) Acked(uid string) bool {
	if !a.c.on(modeFull) {
		return true
	}
	var acked bool
	a.c.acked.run(a.c.labels, "acked", func() { acked = (*a.srv).Acked(uid) })
	return acked
}

// Settled: the stand-in acknowledged its snapshot before the first round.
// Asked of the server where it can say (not every version of
// enroll.ZtunnelAcks has it).
func (a timedAcks) Settled() bool {
	if s, ok := any(*a.srv).(interface{ Settled() bool }); ok {
		return s.Settled()
	}
	return true
}

type timedListeners struct{ c *timedChecks }

func (l timedListeners) Missing(ns *os.File, _ enroll.Variant) ([]uint16, error) {
	if !l.c.on(modeFull) {
		return nil, nil
	}
	var missing []uint16
	var err error
	l.c.listeners.run(l.c.labels, "listeners", func() {
		missing, err = redirect.Listening(ns, []uint16{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE})
	})
	return missing, err
}

// agentEngine is the engine the agent builds for backend: it also clears
// the other backends' leftovers, so each Apply asks each of them whether
// it has anything in the pod (agent.otherBackends).
func agentEngine(tb testing.TB, backend redirect.Backend) *redirect.Engine {
	tb.Helper()
	var others []redirect.Backend
	if backend.Name() != "nftables" {
		others = append(others, redirect.NewNFTables())
	}
	for _, mode := range []redirect.IPTablesMode{redirect.IPTablesNFT, redirect.IPTablesLegacy} {
		if "iptables-"+string(mode) == backend.Name() {
			continue
		}
		if b, err := redirect.NewIPTables(mode); err == nil {
			others = append(others, b)
		} else {
			tb.Logf("no %s backend to clear leftovers of: %v", mode, err)
		}
	}
	return redirect.NewEngine(backend, others...)
}

// verifyBench is a pipeline with benchPods enrolled pods.
type verifyBench struct {
	p      *enroll.Pipeline
	checks *timedChecks
	cache  *podCache
	// notes are logged by the first sub-benchmark: a parent benchmark's
	// log shows only with -v.
	notes []string
	// backend names the rounds in the profile.
	backend string
}

func (v *verifyBench) cached(key types.NamespacedName) *corev1.Pod {
	v.cache.mu.Lock()
	defer v.cache.mu.Unlock()
	return v.cache.pods[key.Namespace+"/"+key.Name]
}

func newVerifyBench(b *testing.B) *verifyBench {
	b.Helper()
	netnstest.RequireRoot(b)
	setupStart := time.Now()
	checks := &timedChecks{labels: context.Background()}
	checks.engine.Store(agentEngine(b, redirect.NewNFTables()))

	node := netnstest.New(b)
	hostProbes := redirect.NewHostProbes(node.Open(b))
	if err := hostProbes.Ensure(); err != nil {
		b.Fatal(err)
	}
	records, err := enrolledrecord.Open(filepath.Join(b.TempDir(), "enrolled"))
	if err != nil {
		b.Fatal(err)
	}
	v := &verifyBench{checks: checks, cache: &podCache{pods: map[string]*corev1.Pod{}, api: map[string]*corev1.Pod{}, namespaces: map[string]*corev1.Namespace{
		"mesh": {ObjectMeta: metav1.ObjectMeta{Name: "mesh", Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient}}},
	}}}
	rec := &recorder{annots: map[types.NamespacedName]string{}}
	// Errors only: the round under measurement must not format log lines
	// nobody asked for, and a repair (logged as a warning) fails the
	// benchmark below anyway.
	log := slog.New(slog.NewTextHandler(tlog{b}, &slog.HandlerOptions{Level: slog.LevelError}))
	var srv *zds.Server
	v.p = enroll.New(enroll.Config{
		Rules:       timedRules{checks},
		Probes:      hostProbes,
		Ztunnel:     ztunnelRef{s: &srv},
		Pods:        v.cache,
		Finder:      timedFinder{c: checks},
		Annotations: rec,
		Records:     records,
		Events:      rec,
		Observer:    rec,
		Logger:      log,
		Listeners:   timedListeners{checks},
		Acks:        timedAcks{checks, &srv},
		Generation:  checks.generation,
	})
	b.Cleanup(v.p.Close)
	sock := filepath.Join(testkit.ShortTempDir(b, "verifybench-"), "ztunnel.sock")
	if srv, err = zds.NewServer(zds.Config{SocketPath: sock, Source: v.p, Logger: log}); err != nil {
		b.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	b.Cleanup(func() { cancel(); <-done })
	z, _ := ztunnel.Start(b, ztunnel.Config{SocketPath: sock})
	testkit.Eventually(b, waitFor, "the stand-in's snapshot", z.SnapshotDone)

	for i := range benchPods {
		sb := sandbox{netnstest.New(b), netip.AddrFrom4([4]byte{10, 99, byte((i + 1) >> 8), byte(i + 1)})}
		sb.Exec(b, "ip", "addr", "add", sb.ip.String()+"/32", "dev", "lo")
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: fmt.Sprintf("bench-%03d", i), UID: uuid.NewUUID()},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: sb.ip.String(), PodIPs: []corev1.PodIP{{IP: sb.ip.String()}}}}
		v.cache.mu.Lock()
		v.cache.pods["mesh/"+pod.Name] = pod
		v.cache.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		out, err := v.p.Add(ctx, request(cnievent.Add, pod, sb, pod.Name+"-sandbox"))
		cancel()
		if out != cnievent.Redirected {
			b.Fatalf("ADD of pod %d = %q, %v", i, out, err)
		}
	}
	if n := len(z.Workloads()); n != benchPods {
		b.Fatalf("the stand-in runs %d workloads, want %d", n, benchPods)
	}
	fds, _ := os.ReadDir("/proc/self/fd")
	v.notes = append(v.notes, fmt.Sprintf("set-up: %d pods enrolled in %v; this process holds %d fds (%d pod netns held by the pipeline and by the stand-in, %d listeners)",
		benchPods, time.Since(setupStart).Round(time.Millisecond), len(fds), benchPods, 3*benchPods))
	return v
}

// roundStats are one mode's rounds.
type roundStats struct {
	walls []time.Duration
	// cpu is user+sys of this process and its children; sys and children
	// are the parts of it in the kernel and in children (iptables-save).
	cpu, sys, children               time.Duration
	sandbox, rules, acked, listeners time.Duration
}

func (s *roundStats) median() time.Duration { return benchreport.Percentile(s.walls, 50) }
func (s *roundStats) p99() time.Duration    { return benchreport.Percentile(s.walls, 99) }

// cpuPerRound is the mean CPU (user+sys, this process and its children)
// of a round.
func (s *roundStats) cpuPerRound() time.Duration { return s.cpu / time.Duration(len(s.walls)) }

// corePercent is the share of one core the verifier takes running such a
// round every verifyPeriod.
func (s *roundStats) corePercent() float64 {
	return 100 * float64(s.cpuPerRound()) / float64(verifyPeriod)
}

// rest is the rounds' wall time outside the per-pod checks.
func (s *roundStats) rest() time.Duration {
	return sum(s.walls) - s.sandbox - s.rules - s.acked - s.listeners
}

// perPod is d summed over the rounds, per round and pod, in µs.
func (s *roundStats) perPod(d time.Duration) float64 {
	return benchreport.Us(d) / float64(len(s.walls)) / benchPods
}

// cpuUse is CPU used so far: user and sys of this process and of its
// waited-for children together, and the children's part of the sum.
type cpuUse struct{ user, sys, children time.Duration }

func cpuNow(tb testing.TB) cpuUse {
	var self, children unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &self); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Getrusage(unix.RUSAGE_CHILDREN, &children); err != nil {
		tb.Fatal(err)
	}
	c := time.Duration(children.Utime.Nano() + children.Stime.Nano())
	return cpuUse{user: time.Duration(self.Utime.Nano() + children.Utime.Nano()), sys: time.Duration(self.Stime.Nano() + children.Stime.Nano()), children: c}
}

func (u cpuUse) since(before cpuUse) cpuUse {
	return cpuUse{u.user - before.user, u.sys - before.sys, u.children - before.children}
}

func (u cpuUse) total() time.Duration { return u.user + u.sys }

// round runs one verification round in mode m and adds it to s. Every
// pod must be found intact: a round that repairs measures something else.
func (v *verifyBench) round(b *testing.B, m verifyMode, s *roundStats) {
	v.checks.mode.Store(int32(m))
	v.checks.reset()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctx = pprof.WithLabels(ctx, pprof.Labels("round", v.backend+": "+m.String()))
	v.checks.labels = ctx
	var res enroll.Verification
	cpu0 := cpuNow(b)
	start := time.Now()
	// What no check's label claims is the round's own.
	pprof.Do(ctx, pprof.Labels("check", "round"), func(ctx context.Context) { res = v.p.VerifyAll(ctx, v.cached) })
	wall := time.Since(start)
	cpu := cpuNow(b).since(cpu0)
	if res.Pods != benchPods || len(res.Repaired) > 0 || len(res.Unproven) > 0 {
		b.Fatalf("%s: verified %d pods, repaired %v, unproven %d; want %d pods found intact", m, res.Pods, res.Repaired, len(res.Unproven), benchPods)
	}
	s.walls = append(s.walls, wall)
	s.cpu += cpu.total()
	s.sys += cpu.sys
	s.children += cpu.children
	c := v.checks
	s.sandbox += c.sandbox.d
	s.rules += c.rules.d
	s.acked += c.acked.d
	s.listeners += c.listeners.d
}

// measure runs rounds of each mode in turn, perIteration of each per b.Loop
// iteration.
func (v *verifyBench) measure(b *testing.B, perIteration int, modes ...verifyMode) map[verifyMode]*roundStats {
	stats := map[verifyMode]*roundStats{}
	for _, m := range modes {
		stats[m] = &roundStats{}
	}
	for b.Loop() {
		for range perIteration {
			for _, m := range modes {
				v.round(b, m, stats[m])
			}
		}
	}
	for _, m := range modes {
		s := stats[m]
		b.Logf("%-26s %3d rounds: median %7.2f ms, p99 %7.2f ms, %6.1f µs/pod; CPU %7.2f ms/round (%.0f %% sys, %.0f %% in children) = %.3f %% of a core every %v",
			m, len(s.walls), benchreport.Ms(s.median()), benchreport.Ms(s.p99()), benchreport.Us(s.median())/benchPods,
			benchreport.Ms(s.cpuPerRound()), 100*float64(s.sys)/float64(s.cpu), 100*float64(s.children)/float64(s.cpu), s.corePercent(), verifyPeriod)
	}
	if s := stats[modeFull]; s != nil {
		var parts []string
		for _, st := range []struct {
			name string
			d    time.Duration
		}{{"sandbox (netlink addresses)", s.sandbox}, {"rules read back", s.rules}, {"ztunnel Ack", s.acked}, {"listeners (sock_diag)", s.listeners}} {
			parts = append(parts, fmt.Sprintf("%s %.1f", st.name, s.perPod(st.d)))
		}
		b.Logf("full round, wall µs per pod: %s; rest of the round (bookkeeping, probe set sync) %.1f", strings.Join(parts, ", "), s.perPod(s.rest()))
	}
	return stats
}

func sum(ds []time.Duration) time.Duration {
	var t time.Duration
	for _, d := range ds {
		t += d
	}
	return t
}

const verifyTarget = "≤ 1 % of a core at --verify-period 10s"

// BenchmarkVerifyAll measures a verification round over 250 enrolled pods
// that are all intact (the steady state), with the nftables backend, and
// then with iptables-nft, the backend the agent picks on a node whose
// kube-proxy writes iptables-nft rules, after converting every pod to it.
func BenchmarkVerifyAll(b *testing.B) {
	v := newVerifyBench(b)
	// The stand-in and the ZDS server idle as they do during a round that
	// finds everything intact: their share of the rounds' CPU. After a
	// collection, so the set-up's garbage is not counted.
	runtime.GC()
	idle := cpuNow(b)
	time.Sleep(time.Second)
	v.notes = append(v.notes, fmt.Sprintf("control: this process idle (stand-in, ZDS server, runtime) takes %.3f %% of a core",
		100*float64(cpuNow(b).since(idle).total())/float64(time.Second)))

	var nft map[verifyMode]*roundStats
	b.Run("nftables", func(b *testing.B) {
		v.backend = "nftables"
		for _, n := range v.notes {
			b.Log(n)
		}
		nft = v.measure(b, 4, modeFull, modeRules, modeEmpty)
		full, rules, empty := nft[modeFull], nft[modeRules], nft[modeEmpty]
		b.ReportMetric(full.corePercent(), "%core@10s")
		b.ReportMetric(benchreport.Ms(full.median()), "round-ms")
		b.ReportMetric(benchreport.Us(full.median())/benchPods, "µs/pod")
		const section = "Verifier: one round over 250 enrolled pods, all intact (nftables backend)"
		const rulesAlone = "rules check alone (nf_tables generation)"
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "CPU at --verify-period 10s (round CPU ÷ 10 s)",
			Value: full.corePercent(), Unit: "% of a core", FloorName: rulesAlone, Floor: rules.corePercent(), Target: verifyTarget})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "CPU per pod and round", Value: benchreport.Us(full.cpuPerRound()) / benchPods, Unit: "µs",
			FloorName: rulesAlone, Floor: benchreport.Us(rules.cpuPerRound()) / benchPods})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "round, median", Value: benchreport.Ms(full.median()), Unit: "ms",
			FloorName: rulesAlone, Floor: benchreport.Ms(rules.median())})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "round, p99", Value: benchreport.Ms(full.p99()), Unit: "ms",
			FloorName: rulesAlone, Floor: benchreport.Ms(rules.p99())})
		for _, st := range []struct {
			name string
			v    float64
		}{
			{"per pod, wall: sandbox check (netlink address list)", full.perPod(full.sandbox)},
			{"per pod, wall: rules read back (and the other backends' leftover check)", full.perPod(full.rules)},
			{"per pod, wall: ztunnel's Ack (from memory)", full.perPod(full.acked)},
			{"per pod, wall: ztunnel's listeners (sock_diag)", full.perPod(full.listeners)},
			{"per pod, wall: the rest (bookkeeping, the probe set sync once a round)", full.perPod(full.rest())},
			{"per pod, wall: a round with no per-pod check (bookkeeping, probe set sync), median ÷ 250", benchreport.Us(empty.median()) / benchPods},
		} {
			benchreport.Record(b, benchreport.Figure{Section: section, Name: st.name, Value: st.v, Unit: "µs"})
		}
	})
	if nft == nil {
		return // filtered out, or failed
	}

	b.Run("iptables-nft", func(b *testing.B) {
		backend, err := redirect.NewIPTables(redirect.IPTablesNFT)
		if err != nil {
			b.Skipf("no iptables-nft: %v", err)
		}
		// Convert every pod (untimed): a round rewrites the rules (the
		// first measured round finds the repair holding). One full round
		// per iteration only: each takes seconds here.
		v.backend = backend.Name()
		v.checks.mode.Store(int32(modeFull))
		v.checks.labels = pprof.WithLabels(context.Background(), pprof.Labels("round", "conversion to "+backend.Name()))
		v.checks.engine.Store(agentEngine(b, backend))
		v.checks.noGeneration.Store(true)
		b.Cleanup(func() { v.checks.noGeneration.Store(false) })
		if res := v.p.VerifyAll(context.Background(), v.cached); res.Repaired[enroll.RepairRules] != benchPods {
			b.Fatalf("converting to iptables-nft repaired %v; want the rules of all %d pods", res.Repaired, benchPods)
		}
		ipt := v.measure(b, 1, modeFull)
		full := ipt[modeFull]
		b.ReportMetric(full.corePercent(), "%core@10s")
		b.ReportMetric(benchreport.Ms(full.median()), "round-ms")
		b.ReportMetric(benchreport.Us(full.median())/benchPods, "µs/pod")
		const section = "Verifier: one round over 250 enrolled pods, all intact, rules read back in full (iptables-nft backend: every 5 min; iptables-legacy: every round)"
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "CPU at --verify-period 10s (round CPU ÷ 10 s, iptables-save children included)",
			Value: full.corePercent(), Unit: "% of a core", FloorName: "nftables backend, same run", Floor: nft[modeFull].corePercent(), Target: verifyTarget})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "round, median", Value: benchreport.Ms(full.median()), Unit: "ms",
			FloorName: "nftables backend, same run", Floor: benchreport.Ms(nft[modeFull].median())})
		benchreport.Record(b, benchreport.Figure{Section: section, Name: "per pod, wall: rules read back (iptables-save per family)", Value: full.perPod(full.rules), Unit: "µs"})
	})
}
