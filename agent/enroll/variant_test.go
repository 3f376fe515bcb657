package enroll_test

import (
	"context"
	"os"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/agent/enroll"
	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/cnievent"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

// variantListeners are ztunnel's ports for a pod of that variant: its DNS
// proxy's only where the pod's DNS is captured (the agent's own rule).
type variantListeners struct{}

func (variantListeners) Missing(ns *os.File, v enroll.Variant) ([]uint16, error) {
	ports := []uint16{ztunnel.PortOutbound, ztunnel.PortInbound, ztunnel.PortHBONE}
	if v.DNSCapture {
		ports = append(ports, ztunnel.PortDNS)
	}
	return redirect.Listening(ns, ports)
}

// Two pods on one node, in two variants, with a ztunnel that runs no DNS
// proxy. Each pod's rules are its variant's, from its ADD through every
// repair, and its proof asks for its variant's listeners: the pod opted
// out of DNS capture has no DNS rules and is proven; the one captured is
// not, for want of the DNS proxy its DNS now goes to. The variant is the
// one decided at the ADD: an annotation edited later changes nothing until
// the pod is enrolled again.
func TestEachPodKeepsItsOwnVariant(t *testing.T) {
	f := newFixture(t)
	f.stopServer()
	f.variantOf = func(pod *corev1.Pod) enroll.Variant {
		return enroll.Variant{DNSCapture: pod.Annotations["test/dns"] == "on", NoInboundCapture: pod.Annotations["test/inbound"] == "off"}
	}
	f.listeners = variantListeners{}
	f.startAgent(nil)
	f.standin(ztunnel.Config{})

	annotated := func(name string, annotations map[string]string) (*corev1.Pod, sandbox) {
		t.Helper()
		pod := f.gated(f.pod("mesh", name, nil))
		pod.Annotations = annotations
		f.cache.mu.Lock()
		f.cache.pods["mesh/"+name] = pod
		f.cache.mu.Unlock()
		sb := f.sandbox()
		if out, err := f.add(pod, sb, name+"-c1"); out != cnievent.Redirected {
			t.Fatalf("ADD of %s = %q, %v", name, out, err)
		}
		return f.running(pod, sb), sb
	}
	dns, dnsSb := annotated("dns", map[string]string{"test/dns": "on"})
	plain, plainSb := annotated("ingress", map[string]string{"test/inbound": "off"})
	rules := func(sb sandbox) string { return sb.Exec(t, "nft", "list", "ruleset") }
	if r := rules(dnsSb); !strings.Contains(r, ":15053") || !strings.Contains(r, ":15006") {
		t.Fatalf("the pod captured for DNS lacks its DNS or inbound rules:\n%s", r)
	}
	if r := rules(plainSb); strings.Contains(r, ":15053") || strings.Contains(r, ":15006") || !strings.Contains(r, ":15001") {
		t.Fatalf("the pod opted out of DNS and inbound capture has the wrong rules:\n%s", r)
	}

	f.verifyAll()
	if c, _ := f.conds.of(plain.UID); !c.proven {
		t.Errorf("the pod opted out of DNS capture = %+v; want proven without a DNS proxy", c)
	}
	if c, _ := f.conds.of(dns.UID); c.proven || c.reason != "DNSProxyMissing" {
		t.Errorf("the pod captured for DNS = %+v; want False/DNSProxyMissing (ztunnel runs no DNS proxy)", c)
	}

	// Flushed, the rules come back in each pod's own variant, even after
	// its annotation changed: the variant is the ADD's.
	edited := plain.DeepCopy()
	edited.Annotations = map[string]string{"test/dns": "on"}
	f.cache.mu.Lock()
	f.cache.pods["mesh/ingress"] = edited
	f.cache.mu.Unlock()
	for _, sb := range []sandbox{dnsSb, plainSb} {
		sb.Exec(t, "nft", "flush", "ruleset")
	}
	f.verifyAll()
	if r := rules(dnsSb); !strings.Contains(r, ":15053") {
		t.Errorf("repaired rules of the pod captured for DNS lack DNS:\n%s", r)
	}
	if r := rules(plainSb); strings.Contains(r, ":15053") || strings.Contains(r, ":15006") || !strings.Contains(r, ":15001") {
		t.Errorf("repaired rules of the opted-out pod are not its ADD's variant:\n%s", r)
	}
	if out, err := f.p.Check(context.Background(), request(cnievent.Check, edited, plainSb, "ingress-c1")); out != cnievent.Redirected {
		t.Errorf("CHECK of the opted-out pod = %q, %v; want its rules found intact in its own variant", out, err)
	}
}
