package enroll_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/enrollment"
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
		Rules: snapshotNoRules{}, Probes: snapshotNoProbes{}, Pods: snapshotPods{}, Ztunnel: ztunnelRef{s: &srv},
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

func (snapshotNoRules) Apply(*os.File, enroll.Variant) (bool, error) {
	return true, nil
}
func (snapshotNoRules) Present(*os.File) (bool, error) { return false, nil }
func (snapshotNoRules) Remove(*os.File) (bool, error)  { return true, nil }

type snapshotNoProbes struct{}

func (snapshotNoProbes) Add(netip.Addr) error    { return nil }
func (snapshotNoProbes) Remove(netip.Addr) error { return nil }
func (snapshotNoProbes) Sync([]netip.Addr, bool) (added, removed []netip.Addr, err error) {
	return nil, nil, nil
}

// snapshotPods knows every pod asked for, enrolled by its label.
type snapshotPods struct{}

func (snapshotPods) Pod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: namespace, Name: name, UID: types.UID(name[len("pod-"):]),
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneAmbient},
	}}, nil
}
func (s snapshotPods) Live(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return s.Pod(ctx, namespace, name)
}
func (snapshotPods) Namespace(_ context.Context, name string) (*corev1.Namespace, error) {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, nil
}

type snapshotNop struct{}

func (snapshotNop) Set(types.NamespacedName, types.UID, string) {}
func (snapshotNop) Warn(*corev1.Pod, string, string)            {}
func (snapshotNop) Enrolled(string, time.Duration)              {}
func (snapshotNop) Failed(string)                               {}
func (snapshotNop) Removed()                                    {}
func (snapshotNop) RanUnredirected()                            {}

// A ztunnel that connects while a pod is being removed gets a snapshot; if
// the pod were still in it when the Del went out, that ztunnel would keep
// the pod's proxy after the Del. The pod leaves the table first, and comes
// back when its removal fails, so a retry still covers it.
func TestUnenrollTakesThePodOutOfSnapshotsBeforeItsDel(t *testing.T) {
	ns := netnstest.New(t)
	var p *enroll.Pipeline
	zt := &snapshotAtDel{p: &p, fail: true}
	p = enroll.New(enroll.Config{
		Rules: snapshotNoRules{}, Probes: snapshotNoProbes{}, Pods: snapshotPods{}, Ztunnel: zt,
		Annotations: snapshotNop{}, Events: snapshotNop{}, Observer: snapshotNop{},
	})
	t.Cleanup(p.Close)
	ctx := context.Background()
	req := &cnievent.Request{Command: cnievent.Add, PodNamespace: "default", PodName: "pod-uid-z", PodUID: "uid-z", Netns: ns.Path}
	if out, err := p.Add(ctx, req); out != cnievent.Redirected || err != nil {
		t.Fatalf("Add = %s, %v", out, err)
	}
	if err := p.Unenroll(ctx, "uid-z"); err == nil {
		t.Fatal("Unenroll succeeded although ztunnel's Del failed")
	}
	if zt.inSnapshotAtDel {
		t.Error("a snapshot taken while the Del was going out still named the pod")
	}
	if !p.IsEnrolled("uid-z") {
		t.Fatal("a pod whose removal failed left the table: a retry would not find it")
	}
	zt.fail = false
	if err := p.Unenroll(ctx, "uid-z"); err != nil {
		t.Fatal(err)
	}
	if zt.inSnapshotAtDel || p.IsEnrolled("uid-z") {
		t.Errorf("after a successful removal: in the snapshot at Del %v, enrolled %v; want neither", zt.inSnapshotAtDel, p.IsEnrolled("uid-z"))
	}
}

// snapshotAtDel takes a snapshot at the moment a Del goes out, as a ztunnel
// connecting then would get it.
type snapshotAtDel struct {
	p               **enroll.Pipeline
	fail            bool
	inSnapshotAtDel bool
}

func (z *snapshotAtDel) Add(context.Context, zds.Workload) error { return nil }
func (z *snapshotAtDel) Del(ctx context.Context, uid string) error {
	ws, err := (*z.p).Snapshot(ctx)
	if err != nil {
		return err
	}
	z.inSnapshotAtDel = false
	for _, w := range ws {
		if w.UID == uid {
			z.inSnapshotAtDel = true
		}
		w.NetNS.Close()
	}
	if z.fail {
		return errors.New("injected: the connection broke")
	}
	return nil
}
