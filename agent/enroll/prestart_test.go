package enroll_test

import (
	"context"
	"strings"
	"testing"

	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// MayStart, asked before a gated pod's container starts: a pod outside the
// mesh always may; an enrolled one only once it is in the table with the
// sandbox its processes run in (procfs), which a sandbox set up without
// inpod, first or again, is not.
func TestMayStartOnlyInTheRedirectedSandbox(t *testing.T) {
	f := newFixture(t)
	f.standin(ztunnel.Config{})
	ctx := context.Background()

	plain, psb := f.pod("plain", "outside", nil), f.sandbox()
	psb.RunAsPod(t, string(plain.UID))
	if err := f.p.MayStart(ctx, "plain", "outside"); err != nil {
		t.Fatalf("a pod outside the mesh was held: %v", err)
	}

	// Set up without inpod (its ADD never came): held.
	pod, sb := f.pod("mesh", "web", nil), f.sandbox()
	sb.RunAsPod(t, string(pod.UID))
	if err := f.p.MayStart(ctx, "mesh", "web"); err == nil || !strings.Contains(err.Error(), "not redirected yet") {
		t.Fatalf("MayStart of an enrolled pod whose ADD never reached inpod = %v, want held", err)
	}
	// Redirected in place: it may start.
	if err := f.p.Reconcile(ctx, f.running(pod, sb)); err != nil {
		t.Fatal(err)
	}
	if err := f.p.MayStart(ctx, "mesh", "web"); err != nil {
		t.Fatalf("MayStart of a pod redirected in its sandbox = %v", err)
	}

	// Its sandbox set up again without inpod, with the same IP: the old
	// one lost its address (the primary CNI's DEL), the new one has it.
	sb.Exec(t, "ip", "addr", "del", sb.ip.String()+"/32", "dev", "lo")
	if err := f.p.MayStart(ctx, "mesh", "web"); err == nil || !strings.Contains(err.Error(), "set up again") {
		t.Fatalf("MayStart with the redirected sandbox gone = %v, want held", err)
	}
	sb2 := f.sandbox()
	sb2.Exec(t, "ip", "addr", "del", sb2.ip.String()+"/32", "dev", "lo")
	sb2.Exec(t, "ip", "addr", "add", sb.ip.String()+"/32", "dev", "lo")
	sb2.RunAsPod(t, string(pod.UID))
	if err := f.p.MayStart(ctx, "mesh", "web"); err == nil || !strings.Contains(err.Error(), "set up again") {
		t.Fatalf("MayStart in a new sandbox inpod did not redirect = %v, want held", err)
	}
	// The refusal makes the next reconcile look, though the status shows
	// the same IPs as before: the new sandbox is redirected, the pod may
	// start.
	if err := f.p.Reconcile(ctx, f.running(pod, sandbox{sb2.NetNS, sb.ip})); err != nil {
		t.Fatal(err)
	}
	if !hasRules(t, sb2) {
		t.Fatal("the reconcile after a refused start did not redirect the new sandbox")
	}
	if err := f.p.MayStart(ctx, "mesh", "web"); err != nil {
		t.Fatalf("MayStart once the new sandbox is redirected = %v", err)
	}

	// Through its CNI ADD, the normal way: it may start.
	fresh, fsb := f.pod("mesh", "api", nil), f.sandbox()
	fsb.RunAsPod(t, string(fresh.UID))
	if out, err := f.add(fresh, fsb, "c-api"); err != nil {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	if err := f.p.MayStart(ctx, "mesh", "api"); err != nil {
		t.Fatalf("MayStart after the pod's own ADD = %v", err)
	}

	// A runtime without an infra process (CRI-O's drop_infra_ctr): before
	// its first container nothing of the pod runs, and the netns its ADD
	// enrolled, still holding its IPs, is its sandbox.
	bare, bsb := f.pod("mesh", "no-infra", nil), f.sandbox()
	if out, err := f.add(bare, bsb, "c-bare"); err != nil {
		t.Fatalf("ADD = %q, %v", out, err)
	}
	if err := f.p.MayStart(ctx, "mesh", "no-infra"); err != nil {
		t.Fatalf("MayStart of a pod with no process yet, in the sandbox its ADD enrolled = %v", err)
	}
}
