package readiness

import (
	"testing"
)

func TestReadyOnlyWhileEveryConditionHolds(t *testing.T) {
	a := New(nil, CNIInstalled, ZtunnelConnected, PodsSynced)
	states, cancel := a.Subscribe()
	defer cancel()
	if st := <-states; st.Ready || len(st.Failing) != 3 {
		t.Fatalf("initial %+v", st)
	}
	a.Set(CNIInstalled, true, "")
	a.Set(PodsSynced, true, "")
	if st := a.State(); st.Ready || len(st.Failing) != 1 || st.Failing[0] != "ztunnel-connected: not checked yet" {
		t.Fatalf("two of three: %+v", st)
	}
	a.Set(ZtunnelConnected, true, "")
	if st := <-states; !st.Ready {
		t.Fatalf("all three: %+v", st)
	}
	a.Set(CNIInstalled, false, "10-calico.conflist does not end with the inpod-cni entry")
	st := <-states
	if st.Ready || st.Failing[0] != "cni-installed: 10-calico.conflist does not end with the inpod-cni entry" {
		t.Fatalf("after the CNI broke: %+v", st)
	}
	if a.Transitions() != 2 {
		t.Fatalf("transitions %d, want 2", a.Transitions())
	}
	// Repeating a value changes nothing and notifies nobody.
	a.Set(CNIInstalled, false, "10-calico.conflist does not end with the inpod-cni entry")
	select {
	case st := <-states:
		t.Fatalf("notified of a non-change: %+v", st)
	default:
	}
}

func TestNoConditionsIsNotReady(t *testing.T) {
	if New(nil).State().Ready {
		t.Fatal("an aggregate of nothing claims ready")
	}
}
