package plugin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/passlist"
	"github.com/inpod-dev/inpod/plugin"
	"github.com/inpod-dev/inpod/plugin/apicheck"
	"github.com/inpod-dev/inpod/plugin/apicheck/apichecktest"
	"github.com/inpod-dev/inpod/plugin/plugintest"
)

// The chain under test: the reference bridge + host-local plugins, then
// inpod-cni, run by libcni exactly as a runtime would, inside a scratch
// "node" netns so the bridge never lands in the host's.

var buildOnce struct {
	sync.Once
	dir string
	err error
}

// pluginDir holds the reference plugins and a freshly built inpod-cni.
func pluginDir(t testing.TB) string {
	t.Helper()
	ref := os.Getenv("INPOD_TEST_CNI_PLUGINS")
	if ref == "" {
		t.Fatal("INPOD_TEST_CNI_PLUGINS is not set: run `make test-unit`, or export INPOD_TEST_CNI_PLUGINS=$(hack/cni-bins.sh)")
	}
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "inpod-cni-bin")
		if err != nil {
			buildOnce.err = err
			return
		}
		buildOnce.dir = dir
		for _, p := range []string{"bridge", "host-local", "loopback"} {
			data, err := os.ReadFile(filepath.Join(ref, p))
			if err == nil {
				err = os.WriteFile(filepath.Join(dir, p), data, 0o755)
			}
			if err != nil {
				buildOnce.err = err
				return
			}
		}
		buildOnce.err = plugintest.Build(dir)
	})
	if buildOnce.err != nil {
		t.Fatal(buildOnce.err)
	}
	return buildOnce.dir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if buildOnce.dir != "" {
		os.RemoveAll(buildOnce.dir)
	}
	os.Exit(code)
}

// agent is a real cniserver whose pipeline the test scripts.
type agent struct {
	mu      sync.Mutex
	seen    []cnievent.Request
	verdict func(*cnievent.Request) (cnievent.Outcome, error)
}

func (a *agent) handle(req *cnievent.Request) (cnievent.Outcome, error) {
	a.mu.Lock()
	a.seen = append(a.seen, *req)
	v := a.verdict
	a.mu.Unlock()
	return v(req)
}
func (a *agent) Add(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return a.handle(r)
}
func (a *agent) Del(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return a.handle(r)
}
func (a *agent) Check(_ context.Context, r *cnievent.Request) (cnievent.Outcome, error) {
	return a.handle(r)
}
func (a *agent) requests() []cnievent.Request {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]cnievent.Request(nil), a.seen...)
}

// enrolledIf answers like the agent: pods whose name starts with "mesh-"
// are enrolled and get redirected; others are not enrolled.
func enrolledIf(req *cnievent.Request) (cnievent.Outcome, error) {
	if strings.HasPrefix(req.PodName, "mesh-") {
		return cnievent.Redirected, nil
	}
	return cnievent.NotEnrolled, nil
}

func startAgent(t testing.TB, socket string, a *agent) (stop func()) {
	t.Helper()
	srv, err := cniserver.New(cniserver.Config{SocketPath: socket, Handler: a})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

type chain struct {
	t      *testing.T
	node   *os.File
	cni    *libcni.CNIConfig
	list   *libcni.NetworkConfigList
	socket string
}

func newChain(t *testing.T, apiAccess string) *chain {
	t.Helper()
	node := netnstest.New(t)
	dir := t.TempDir()
	socket := filepath.Join(dir, "run", "cni.sock")
	inpod := map[string]any{"type": plugin.PluginType, "agentSocket": socket, "excludeNamespaces": []string{"kube-system"}, "timeout": "10s"}
	if apiAccess != "" {
		inpod["apiAccess"] = apiAccess
	}
	conf, _ := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "test",
		"plugins": []any{
			map[string]any{"type": "bridge", "bridge": "tbr0", "isGateway": true,
				"ipam": map[string]any{"type": "host-local", "subnet": "198.51.100.0/24", "dataDir": filepath.Join(dir, "ipam")}},
			inpod,
		},
	})
	list, err := libcni.ConfListFromBytes(conf)
	if err != nil {
		t.Fatal(err)
	}
	return &chain{t: t, node: node.Open(t), list: list, socket: socket,
		cni: libcni.NewCNIConfigWithCacheDir([]string{pluginDir(t)}, filepath.Join(dir, "cache"), nil)}
}

// setAPIAccess points the plugin's entry at an API access file.
func (c *chain) setAPIAccess(t *testing.T, path string) {
	t.Helper()
	c.setEntry(t, "apiAccess", path)
}

// setEntry sets a field of the plugin's entry.
func (c *chain) setEntry(t *testing.T, field string, value any) {
	t.Helper()
	var conf map[string]any
	if err := json.Unmarshal(c.list.Bytes, &conf); err != nil {
		t.Fatal(err)
	}
	plugins := conf["plugins"].([]any)
	plugins[len(plugins)-1].(map[string]any)[field] = value
	data, _ := json.Marshal(conf)
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		t.Fatal(err)
	}
	c.list = list
}

func (c *chain) rt(pod *netnstest.NetNS, ns, name string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: "c-" + name, NetNS: pod.Path, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", ns}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", "uid-" + name}},
	}
}

// in runs a libcni call with the node netns as the plugins' host netns.
func (c *chain) in(fn func() error) error {
	return netns.Do(c.node, fn)
}

func (c *chain) add(rt *libcni.RuntimeConf) (*types100.Result, error) {
	var res *types100.Result
	err := c.in(func() error {
		r, err := c.cni.AddNetworkList(context.Background(), c.list, rt)
		if err != nil {
			return err
		}
		res, err = types100.NewResultFromResult(r)
		return err
	})
	return res, err
}

func (c *chain) check(rt *libcni.RuntimeConf) error {
	return c.in(func() error { return c.cni.CheckNetworkList(context.Background(), c.list, rt) })
}

func (c *chain) del(rt *libcni.RuntimeConf) error {
	return c.in(func() error { return c.cni.DelNetworkList(context.Background(), c.list, rt) })
}

func TestChainPassesNonEnrolledAndGatesEnrolledOnTheAgent(t *testing.T) {
	c := newChain(t, "")
	a := &agent{verdict: enrolledIf}
	startAgent(t, c.socket, a)

	plain := netnstest.New(t)
	rt := c.rt(plain, "default", "plain")
	res, err := c.add(rt)
	if err != nil {
		t.Fatalf("ADD of a non-enrolled pod: %v", err)
	}
	if len(res.IPs) != 1 || !strings.HasPrefix(res.IPs[0].Address.IP.String(), "198.51.100.") {
		t.Fatalf("result lost the bridge's IP: %+v", res)
	}
	if err := c.check(rt); err != nil {
		t.Fatalf("CHECK of a non-enrolled pod: %v", err)
	}
	if err := c.del(rt); err != nil {
		t.Fatalf("DEL of a non-enrolled pod: %v", err)
	}

	mesh := netnstest.New(t)
	rt = c.rt(mesh, "default", "mesh-1")
	res, err = c.add(rt)
	if err != nil {
		t.Fatalf("ADD of an enrolled pod the agent redirected: %v", err)
	}
	var add *cnievent.Request
	for _, r := range a.requests() {
		if r.Command == cnievent.Add && r.PodName == "mesh-1" {
			add = &r
		}
	}
	if add == nil || add.Netns != mesh.Path || add.PodUID != "uid-mesh-1" || add.ContainerID != "c-mesh-1" ||
		len(add.IPs) != 1 || add.IPs[0] != res.IPs[0].Address.IP.String() {
		t.Fatalf("agent got %+v, want the pod's identity, netns and the IP from prevResult %v", add, res.IPs)
	}
	if err := c.check(rt); err != nil {
		t.Fatalf("CHECK: %v", err)
	}

	// The agent refuses: the ADD fails, naming the pod and the cause.
	a.mu.Lock()
	a.verdict = func(*cnievent.Request) (cnievent.Outcome, error) {
		return cnievent.Failed, fmt.Errorf("ztunnel did not ack within 5s")
	}
	a.mu.Unlock()
	failing := netnstest.New(t)
	rt2 := c.rt(failing, "default", "mesh-2")
	_, err = c.add(rt2)
	if err == nil || !strings.Contains(err.Error(), "default/mesh-2") || !strings.Contains(err.Error(), "did not ack") {
		t.Fatalf("ADD with a failing agent = %v, want an error naming the pod and the cause", err)
	}
	if err := c.del(rt2); err != nil {
		t.Fatalf("DEL after a failed ADD: %v", err)
	}
	if err := c.check(rt); err == nil {
		t.Fatal("CHECK passed while the agent reports the redirection broken")
	}

	// Excluded namespaces are never sent to the agent.
	before := len(a.requests())
	sys := netnstest.New(t)
	if _, err := c.add(c.rt(sys, "kube-system", "mesh-dns")); err != nil {
		t.Fatalf("ADD in an excluded namespace: %v", err)
	}
	if len(a.requests()) != before {
		t.Fatal("the plugin asked the agent about a pod in an excluded namespace")
	}
}

// fakeAPI serves pod and namespace labels the way the API server does,
// listening inside the node netns where the plugin runs, and returns the
// access file for it.
func fakeAPI(t *testing.T, node *os.File, podLabels, nsLabels map[string]map[string]string) string {
	t.Helper()
	var ln net.Listener
	if err := netns.Do(node, func() error {
		var err error
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	access := apichecktest.Serve(t, ln, podLabels, nsLabels)
	path := filepath.Join(t.TempDir(), "api-access.json")
	data, _ := json.Marshal(access)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestAgentDownFailsEnrolledAndPassesOthers(t *testing.T) {
	c := newChain(t, "")
	access := fakeAPI(t, c.node,
		map[string]map[string]string{
			"default/mesh-pod":  {apicheck.DataplaneModeLabel: apicheck.DataplaneAmbient},
			"default/plain":     {},
			"ambient/app":       {},
			"ambient/opted-out": {apicheck.DataplaneModeLabel: apicheck.DataplaneNone},
		},
		map[string]map[string]string{"default": {}, "ambient": {apicheck.DataplaneModeLabel: apicheck.DataplaneAmbient}},
	)
	c.setAPIAccess(t, access)
	// No agent is listening on c.socket.
	cases := []struct {
		ns, name string
		enrolled bool
	}{
		{"default", "mesh-pod", true},
		{"ambient", "app", true},
		{"default", "plain", false},
		{"ambient", "opted-out", false},
	}
	for _, tc := range cases {
		pod := netnstest.New(t)
		rt := c.rt(pod, tc.ns, tc.name)
		_, err := c.add(rt)
		if tc.enrolled {
			if err == nil || !strings.Contains(err.Error(), tc.ns+"/"+tc.name+" is enrolled in the mesh") || !strings.Contains(err.Error(), "unreachable") {
				t.Errorf("%s/%s (enrolled) with the agent down: ADD = %v, want a clear failure", tc.ns, tc.name, err)
			}
		} else if err != nil {
			t.Errorf("%s/%s (not enrolled) with the agent down: ADD = %v, want it to pass", tc.ns, tc.name, err)
		}
		if err := c.del(rt); err != nil {
			t.Errorf("DEL with the agent down: %v", err)
		}
	}
}

func TestPassListSkipsTheAgentOnlyForListedPodsWhileTheAgentLives(t *testing.T) {
	c := newChain(t, "")
	a := &agent{verdict: enrolledIf}
	startAgent(t, c.socket, a)
	dir := filepath.Join(t.TempDir(), "not-enrolled")
	list, err := passlist.Open(dir, func(_, name string) (string, bool, bool) {
		return "uid-" + name, !strings.HasPrefix(name, "mesh-"), true
	}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"plain", "mesh-1", "reused"} {
		list.Refresh("default", name)
	}
	ctx, cancel := context.WithCancel(context.Background())
	beating := make(chan struct{})
	go func() { list.Run(ctx); close(beating) }()
	t.Cleanup(func() { cancel(); <-beating })
	testkit.Eventually(t, 5*time.Second, "the pass list to become live", func() bool {
		return passlist.Passes(dir, "default", "plain", "uid-plain")
	})
	c.setEntry(t, "passList", dir)
	asked := func(rt *libcni.RuntimeConf) bool {
		t.Helper()
		before := len(a.requests())
		if _, err := c.add(rt); err != nil {
			t.Fatalf("ADD %v: %v", rt.Args, err)
		}
		return len(a.requests()) > before
	}

	if asked(c.rt(netnstest.New(t), "default", "plain")) {
		t.Error("the agent was asked about a pod on its pass list")
	}
	if !asked(c.rt(netnstest.New(t), "default", "mesh-1")) {
		t.Error("an enrolled pod passed without the agent")
	}
	if !asked(c.rt(netnstest.New(t), "default", "unlisted")) {
		t.Error("a pod the agent has not listed passed without it")
	}
	other := c.rt(netnstest.New(t), "default", "reused")
	other.Args[3][1] = "uid-of-a-newer-pod"
	if !asked(other) {
		t.Error("a sandbox of another pod with a listed name passed without the agent")
	}
	// The agent stops: its list is withdrawn with it.
	cancel()
	<-beating
	again := c.rt(netnstest.New(t), "default", "plain")
	again.ContainerID = "c-plain-again"
	if !asked(again) {
		t.Error("a stopped agent's pass list was still trusted")
	}
}

func TestAgentDownWithoutTheAPICheckBinaryFailsClosed(t *testing.T) {
	c := newChain(t, "")
	c.setAPIAccess(t, fakeAPI(t, c.node, map[string]map[string]string{"default/plain": {}}, map[string]map[string]string{"default": {}}))
	// A bin dir with everything but inpod-cni-apicheck.
	bin := t.TempDir()
	for _, name := range []string{"bridge", "host-local", plugin.PluginType} {
		if err := os.Link(filepath.Join(pluginDir(t), name), filepath.Join(bin, name)); err != nil {
			t.Fatal(err)
		}
	}
	c.cni = libcni.NewCNIConfigWithCacheDir([]string{bin}, filepath.Join(t.TempDir(), "cache"), nil)
	pod := netnstest.New(t)
	_, err := c.add(c.rt(pod, "default", "plain"))
	if err == nil || !strings.Contains(err.Error(), "inpod-cni-apicheck not found in CNI_PATH") {
		t.Fatalf("ADD with the agent down and no inpod-cni-apicheck = %v, want a failure naming the missing binary", err)
	}
	c.del(c.rt(pod, "default", "plain"))
}

func TestAgentAndAPIDownFailsClosedWithReason(t *testing.T) {
	c := newChain(t, "")
	pod := netnstest.New(t)
	_, err := c.add(c.rt(pod, "default", "any"))
	if err == nil || !strings.Contains(err.Error(), "could not be decided") {
		t.Fatalf("ADD with neither agent nor API access = %v, want a failure that says why", err)
	}
	c.del(c.rt(pod, "default", "any"))
}

func TestStatusAndGCThroughLibcni(t *testing.T) {
	c := newChain(t, "")
	ctx := context.Background()
	if err := c.in(func() error { return c.cni.GetStatusNetworkList(ctx, c.list) }); err != nil {
		t.Fatalf("STATUS: %v", err)
	}
	if err := c.in(func() error { return c.cni.GCNetworkList(ctx, c.list, &libcni.GCArgs{}) }); err != nil {
		t.Fatalf("GC: %v", err)
	}
}
