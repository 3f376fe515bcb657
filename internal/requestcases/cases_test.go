package requestcases

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/enrollment"
)

// The table's idea of who is enrolled is the agent's: admission gates
// exactly the pods the agent will redirect (a pod it enrolls without the
// gate could start unredirected; one gated but not enrolled would wait).
func TestEnrolledIsTheAgents(t *testing.T) {
	policy := enrollment.Policy{ExcludedNamespaces: []string{Excluded}, Label: Label}
	nss := map[string]*corev1.Namespace{}
	for _, ns := range Namespaces() {
		nss[ns.Name] = ns
	}
	ks := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Excluded}}
	LabelExcluded(ks)
	nss[Excluded] = ks
	for _, c := range Cases() {
		ns, ok := nss[c.Pod.Namespace]
		if !ok {
			t.Fatalf("case %s: namespace %s not in the table", c.Pod.Name, c.Pod.Namespace)
		}
		if got, agent := c.Enrolled(), policy.Enrolled(c.Pod, ns); got != agent {
			t.Errorf("pod %s/%s: the table says enrolled %t (want %s), the agent %t", c.Pod.Namespace, c.Pod.Name, got, c.Want, agent)
		}
	}
}
