package apicheck_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/apiaccess"
	"github.com/inpod-dev/inpod/plugin/apicheck"
	"github.com/inpod-dev/inpod/plugin/apicheck/apichecktest"
)

func fakeAPI(t *testing.T, pods, namespaces map[string]map[string]string) *apiaccess.Access {
	return apichecktest.Serve(t, nil, pods, namespaces)
}

func TestDecideAppliesTheAgentsRules(t *testing.T) {
	ambient := map[string]string{apicheck.DataplaneModeLabel: apicheck.DataplaneAmbient}
	none := map[string]string{apicheck.DataplaneModeLabel: apicheck.DataplaneNone}
	a := fakeAPI(t,
		map[string]map[string]string{
			"plain/opted-in": ambient, "plain/app": nil,
			"mesh/app": {"app": "x"}, "mesh/opted-out": none,
		},
		map[string]map[string]string{"plain": nil, "mesh": ambient},
	)
	cases := []struct {
		ns, name string
		enrolled bool
		reason   string
	}{
		{"plain", "opted-in", true, "pod label"},
		{"plain", "app", false, ""},
		{"mesh", "app", true, "namespace label"},
		{"mesh", "opted-out", false, ""},
	}
	for _, tc := range cases {
		v, err := apicheck.Decide(context.Background(), a, tc.ns, tc.name)
		if err != nil {
			t.Errorf("%s/%s: %v", tc.ns, tc.name, err)
			continue
		}
		if v.Enrolled != tc.enrolled || !strings.Contains(v.Reason, tc.reason) {
			t.Errorf("%s/%s: %+v, want enrolled=%v with a reason containing %q", tc.ns, tc.name, v, tc.enrolled, tc.reason)
		}
	}
}

func TestDecideReadsTheAgentsEnrollmentLabel(t *testing.T) {
	custom := map[string]string{"mesh.example.com/mode": apicheck.DataplaneAmbient}
	istio := map[string]string{apicheck.DataplaneModeLabel: apicheck.DataplaneAmbient}
	a := fakeAPI(t,
		map[string]map[string]string{"plain/custom": custom, "plain/istio": istio, "mesh/app": nil},
		map[string]map[string]string{"plain": nil, "mesh": custom},
	)
	a.EnrollmentLabel = "mesh.example.com/mode"
	for _, tc := range []struct {
		ns, name string
		enrolled bool
	}{{"plain", "custom", true}, {"plain", "istio", false}, {"mesh", "app", true}} {
		v, err := apicheck.Decide(context.Background(), a, tc.ns, tc.name)
		if err != nil || v.Enrolled != tc.enrolled {
			t.Errorf("%s/%s with the agent's label: %+v, %v; want enrolled=%v", tc.ns, tc.name, v, err, tc.enrolled)
		}
	}
}

// Anything short of an answer is an error, never "not enrolled": the plugin
// fails the ADD closed on it.
func TestDecideErrorsInsteadOfGuessing(t *testing.T) {
	a := fakeAPI(t, map[string]map[string]string{"ns/app": nil}, nil)
	if _, err := apicheck.Decide(context.Background(), a, "ns", "gone"); err == nil || !strings.Contains(err.Error(), "404") || !strings.Contains(err.Error(), "not found") {
		t.Errorf("unknown pod: %v", err)
	}
	if _, err := apicheck.Decide(context.Background(), a, "ns", "app"); err == nil || !strings.Contains(err.Error(), "namespaces/ns") {
		t.Errorf("pod whose namespace cannot be read: %v", err)
	}
	wrongToken := *a
	wrongToken.Token = "stale"
	if _, err := apicheck.Decide(context.Background(), &wrongToken, "ns", "app"); err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("rejected token: %v", err)
	}
	otherCA := *a
	otherCA.CAData = nil
	if _, err := apicheck.Decide(context.Background(), &otherCA, "ns", "app"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("server certificate not signed by the given CA: %v", err)
	}
	garbageCA := *a
	garbageCA.CAData = []byte("not pem")
	if _, err := apicheck.Decide(context.Background(), &garbageCA, "ns", "app"); err == nil || !strings.Contains(err.Error(), "caData") {
		t.Errorf("garbage caData: %v", err)
	}
}

// A rejected token that the access file says has expired names the cause:
// the agent stopped renewing it.
func TestDecideExplainsAnExpiredToken(t *testing.T) {
	a := fakeAPI(t, map[string]map[string]string{"ns/app": nil}, map[string]map[string]string{"ns": nil})
	a.Token = "stale"
	a.Expires = time.Now().Add(-time.Hour)
	if _, err := apicheck.Decide(context.Background(), a, "ns", "app"); err == nil || !strings.Contains(err.Error(), "401") || !strings.Contains(err.Error(), "expired") {
		t.Errorf("expired token: %v", err)
	}
	// Still asked: the node's clock may be wrong, the API server decides.
	a.Token = "test-token"
	if _, err := apicheck.Decide(context.Background(), a, "ns", "app"); err != nil {
		t.Errorf("a token the API server accepts, past its expiry by the node's clock: %v", err)
	}
}
