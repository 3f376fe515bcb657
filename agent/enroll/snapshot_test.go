package enroll_test

import (
	"context"
	"net/netip"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// The files a snapshot hands out are the server's: an unenroll that closes
// the table's file after Snapshot returned (the server sends without the
// table's lock) must leave them open.
func TestSnapshotFilesOutliveAnUnenroll(t *testing.T) {
	pods := map[string]*netnstest.NetNS{"uid-x": netnstest.New(t), "uid-y": netnstest.New(t)}
	var srv *zds.Server // the pipeline is the server's source, the server its ztunnel
	p := enroll.New(enroll.Config{
		Rules: snapshotNoRules{}, Probes: snapshotNoProbes{}, Pods: snapshotPods{}, Ztunnel: snapshotZtunnel{&srv},
		Annotations: snapshotNop{}, Events: snapshotNop{}, Observer: snapshotNop{},
	})
	t.Cleanup(p.Close)
	path := testkit.ShortTempDir(t, "zds") + "/zt.sock"
	srv, err := zds.NewServer(zds.Config{SocketPath: path, Source: p})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { srv.Serve(ctx); close(served) }()
	z := ztunnel.New(ztunnel.Config{SocketPath: path, MinBackoff: 10 * time.Millisecond})
	ran := make(chan struct{})
	go func() { z.Run(ctx); close(ran) }()
	t.Cleanup(func() { cancel(); <-served; <-ran })
	testkit.Eventually(t, 10*time.Second, "ztunnel ready", func() bool { return srv.State().Ready })

	for uid, ns := range pods {
		req := &cnievent.Request{Command: cnievent.Add, PodNamespace: "default", PodName: "pod-" + uid, PodUID: uid, Netns: ns.Path}
		if out, err := p.Add(ctx, req); out != cnievent.Redirected || err != nil {
			t.Fatalf("Add %s = %s, %v", uid, out, err)
		}
	}
	ws, err := p.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, w := range ws {
			w.NetNS.Close()
		}
	}()
	if err := p.Unenroll(ctx, "uid-x"); err != nil {
		t.Fatal(err)
	}
	if len(ws) != 2 {
		t.Fatalf("snapshot has %d entries, want 2", len(ws))
	}
	for _, w := range ws {
		want, err := netns.IdentityOfPath(pods[w.UID].Path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := netns.IdentityOf(int(w.NetNS.Fd()))
		if err != nil || got != want {
			t.Errorf("snapshot's netns of %s after the unenroll: %v, %v; want an open fd of %v", w.UID, got, err, want)
		}
	}
}

type snapshotNoRules struct{}

func (snapshotNoRules) Apply(*os.File, redirect.Options) (redirect.Result, error) {
	return redirect.Result{Changed: true}, nil
}
func (snapshotNoRules) Remove(*os.File) (bool, error) { return true, nil }

type snapshotNoProbes struct{}

func (snapshotNoProbes) Add(netip.Addr) error     { return nil }
func (snapshotNoProbes) Remove(netip.Addr) error  { return nil }
func (snapshotNoProbes) Prune([]netip.Addr) error { return nil }

// snapshotPods knows every pod asked for, enrolled by its label.
type snapshotPods struct{}

func (snapshotPods) Pod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: namespace, Name: name, UID: types.UID(name[len("pod-"):]),
		Labels: map[string]string{enroll.DataplaneModeLabel: enroll.DataplaneAmbient},
	}}, nil
}
func (snapshotPods) Namespace(name string) (*corev1.Namespace, error) {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, nil
}

type snapshotNop struct{}

func (snapshotNop) Set(types.NamespacedName, string) {}
func (snapshotNop) Warn(*corev1.Pod, string, string) {}
func (snapshotNop) Enrolled(string, time.Duration)   {}
func (snapshotNop) Failed(string)                    {}
func (snapshotNop) Removed()                         {}

type snapshotZtunnel struct{ srv **zds.Server }

func (z snapshotZtunnel) Add(ctx context.Context, w zds.Workload) error { return (*z.srv).Add(ctx, w) }
func (z snapshotZtunnel) Del(ctx context.Context, uid string) error     { return (*z.srv).Del(ctx, uid) }
