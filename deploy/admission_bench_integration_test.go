//go:build integration

package deploy_test

import (
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/requestcases"
	"github.com/inpod-dev/inpod/internal/testkit"
)

// admissionRate is issue 38's pace for the admission figures, in pods/s.
const admissionRate = 100

// admissionPodsEnv overrides the number of pods a stream creates (default
// 1500: 15 s at admissionRate).
const admissionPodsEnv = "INPOD_BENCH_ADMISSION_PODS"

// admissionMode is one way inpod mutates pods at their creation.
type admissionMode struct {
	name   string // in the figures
	metric string // in b.ReportMetric's units and the streams' pod names
	// install creates the mode's objects and returns what to delete to
	// remove it again.
	install func(b *testing.B) []*unstructured.Unstructured
	// applied says what got, admission's take on orig, lacks of the mode's
	// mutation.
	applied func(orig, got *corev1.Pod) error
}

// BenchmarkIntegrationAdmission measures what inpod's admission costs a
// pod's creation (issue 38, item 4): on one real API server, a stream of
// plain enrolled pods created at 100 pods/s, open loop (each create in its
// own goroutine, so a slow one does not hold back the next), with each of
// inpod's admission modes installed: the default install's
// MutatingAdmissionPolicies (request and readiness gate), the init-container
// gate's (inpod-wait-ready besides, and its guard's
// ValidatingAdmissionPolicy), and mode=webhook (inpod-controller's webhook,
// served by this process over TLS on localhost). Each stream's create
// latency p50/p99 is recorded beside the same stream's on the same API
// server with no inpod admission object installed, measured just before it
// (a floor per mode, since the API server's latency drifts as etcd grows
// and caches warm). Every stored pod of a stream is checked to carry the
// mode's mutation (or none, for a floor), so a mode that silently did not
// apply (the webhook's failurePolicy is Ignore) fails the benchmark rather
// than reporting a floor as its cost. Where the difference goes is logged
// per stream: the API server's CPU and its own latency histograms
// (request, admission steps, plugins, webhooks) per create, and this
// process's CPU (the client's, and the webhook's in webhook mode). Run it with -benchtime 1x; INPOD_BENCH_ADMISSION_PODS
// sets the pods per stream.
func BenchmarkIntegrationAdmission(b *testing.B) {
	pods := 1500
	if s := os.Getenv(admissionPodsEnv); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 2 {
			b.Fatalf("%s=%q: want a number of pods, at least 2", admissionPodsEnv, s)
		}
		pods = n
	}
	a := startAPIServer(b)
	// client-go's default of 5 requests/s would pace the stream itself, and
	// its wait would count as create latency.
	rc := rest.CopyConfig(a.Rest)
	rc.QPS = -1
	c, err := kubernetes.NewForConfig(rc)
	if err != nil {
		b.Fatal(err)
	}
	// mesh: enrolled by its label.
	ns := requestcases.Namespaces()[0]
	if _, err := c.CoreV1().Namespaces().Create(b.Context(), ns, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	s := &admissionStreams{a: a, c: c, ns: ns.Name}

	modes := []admissionMode{
		{
			name: "request policy (default install's MutatingAdmissionPolicies: request, readiness gate)", metric: "request-policy",
			install: func(b *testing.B) []*unstructured.Unstructured {
				objs := kinds(render(b), "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
				a.create(b, false, objs...)
				return objs
			},
			applied: requestAndGate,
		},
		{
			name: "init-container policy (gates deviceplugin,initcontainer: request, readiness gate, inpod-wait-ready and its guard)", metric: "initcontainer-policy",
			install: func(b *testing.B) []*unstructured.Unstructured {
				objs := kinds(render(b, "--set", "gates={deviceplugin,initcontainer}", "--set", "initContainer.image.tag=test"),
					"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
				a.create(b, false, objs...)
				return objs
			},
			applied: func(orig, got *corev1.Pod) error {
				return errors.Join(requestAndGateOnly(orig, got), waitReady(orig, got, true))
			},
		},
		{
			name: "webhook mode (inpod-controller's webhook: request, readiness gate)", metric: "webhook",
			install: func(b *testing.B) []*unstructured.Unstructured {
				mwc := a.startRequestWebhook(b)
				a.create(b, false, mwc)
				return []*unstructured.Unstructured{mwc}
			},
			applied: requestAndGate,
		},
	}

	// The first creates on a fresh API server pay for its cold caches and
	// the client's connection: no mode should pay for them in its floor.
	s.stream(b, "warm-up", min(pods, 200), notMutated)
	for _, m := range modes {
		floor := s.stream(b, "floor-"+m.metric, pods, notMutated)
		objs := m.install(b)
		// A policy takes effect a few seconds after it is created.
		s.waitAdmission(b, m.name+" to apply", m.applied)
		got := s.stream(b, m.metric, pods, m.applied)
		a.remove(b, objs...)
		s.waitAdmission(b, m.name+" to be gone", notMutated)

		for _, p := range []int{50, 99} {
			benchreport.Record(b, benchreport.Figure{Section: benchreport.ScaleAdmissionSection,
				Name:  fmt.Sprintf("pod create latency p%d at %d pods/s (%d pods), %s", p, admissionRate, pods, m.name),
				Value: benchreport.Ms(benchreport.Percentile(got, p)), Unit: "ms",
				FloorName: "the same stream, no inpod admission object", Floor: benchreport.Ms(benchreport.Percentile(floor, p)),
				Target: "measured"})
		}
		b.ReportMetric(benchreport.Ms(benchreport.Percentile(got, 99)), m.metric+"-p99-ms")
		b.ReportMetric(benchreport.Ms(benchreport.Percentile(floor, 99)), m.metric+"-floor-p99-ms")
	}
}

// admissionStreams creates paced streams of pods in ns.
type admissionStreams struct {
	a  *apiserver
	c  kubernetes.Interface // not rate-limited
	ns string
}

// benchPod is a plain pod of the enrolled namespace: enrolled by its
// namespace's label, as most are.
func (s *admissionStreams) benchPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: name},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "registry.k8s.io/pause:3.10"}}},
	}
}

// stream creates n pods named prefix-i at admissionRate and returns each
// create's latency; it checks every stored pod with want and deletes them
// all, so that each stream starts from the same empty namespace.
func (s *admissionStreams) stream(b *testing.B, prefix string, n int, want func(orig, got *corev1.Pod) error) []time.Duration {
	b.Helper()
	ctx := b.Context()
	pods := s.c.CoreV1().Pods(s.ns)
	before, selfBefore := s.a.serverTimes(b), cpuTime(b)
	latency := make([]time.Duration, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / admissionRate)
	start := time.Now()
	var lastIssued time.Time
	for i := range n {
		if i > 0 {
			<-tick.C
		}
		p := s.benchPod(fmt.Sprintf("%s-%d", prefix, i))
		lastIssued = time.Now()
		wg.Go(func() {
			t0 := time.Now()
			_, errs[i] = pods.Create(ctx, p, metav1.CreateOptions{})
			latency[i] = time.Since(t0)
		})
	}
	tick.Stop()
	wg.Wait()
	took := time.Since(start)
	self := cpuTime(b) - selfBefore
	after := s.a.serverTimes(b)
	if err := errors.Join(errs...); err != nil {
		b.Fatalf("%s: creates failed: %v", prefix, err)
	}
	issued := lastIssued.Sub(start)
	// A ticker drops ticks when the loop falls behind: a stream issued
	// well below the pace is not the figure it claims to be.
	if rate := float64(n-1) / issued.Seconds(); n > 1 && rate < 0.9*admissionRate {
		b.Errorf("%s: creates issued at %.1f pods/s, under 90 %% of the %d pods/s measured", prefix, rate, admissionRate)
	}
	b.Logf("%s: %d creates issued at %.1f pods/s (over %s), all returned after %s; p50 %s, p99 %s, max %s",
		prefix, n, float64(n-1)/issued.Seconds(), issued.Round(time.Millisecond), took.Round(time.Millisecond),
		benchreport.Percentile(latency, 50).Round(10*time.Microsecond), benchreport.Percentile(latency, 99).Round(10*time.Microsecond),
		slices.Max(latency).Round(10*time.Microsecond))
	b.Logf("%s: per create, the API server's %s; this process's (client, webhook) CPU %s",
		prefix, after.perCreate(before, n), (self / time.Duration(n)).Round(10*time.Microsecond))

	stored, err := pods.List(ctx, metav1.ListOptions{})
	if err != nil {
		b.Fatal(err)
	}
	if len(stored.Items) != n {
		b.Fatalf("%s: %d pods stored, %d created", prefix, len(stored.Items), n)
	}
	var wrong []error
	for i := range stored.Items {
		got := &stored.Items[i]
		if err := want(s.benchPod(got.Name), got); err != nil {
			wrong = append(wrong, fmt.Errorf("%s: %w", got.Name, err))
		}
	}
	if len(wrong) > 0 {
		b.Fatalf("%s: %d of %d stored pods are not as admission should have made them, first: %v", prefix, len(wrong), n, wrong[0])
	}

	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		b.Fatal(err)
	}
	// Pods bound to no node are deleted at once, without a grace period.
	if err := testkit.Poll(time.Minute, prefix+"'s pods to be gone", func() (bool, error) {
		l, err := pods.List(ctx, metav1.ListOptions{Limit: 1})
		return err == nil && len(l.Items) == 0, err
	}); err != nil {
		b.Fatal(err)
	}
	return latency
}

// waitAdmission waits until admission makes of a pod what want wants (a
// dry-run create, nothing stored).
func (s *admissionStreams) waitAdmission(b *testing.B, what string, want func(orig, got *corev1.Pod) error) {
	b.Helper()
	orig := s.benchPod("probe")
	var last error
	err := testkit.Poll(30*time.Second, what, func() (bool, error) {
		got, err := s.c.CoreV1().Pods(s.ns).Create(b.Context(), orig.DeepCopy(), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			return false, err
		}
		last = want(orig, got)
		return last == nil, nil
	})
	if err != nil {
		b.Fatalf("%v (last: %v)", err, last)
	}
}

// requestAndGate: got gained the request on its container and the readiness
// gate, and no init container.
func requestAndGate(orig, got *corev1.Pod) error {
	return errors.Join(requestAndGateOnly(orig, got), waitReady(orig, got, false))
}

// requestAndGateOnly is requestAndGate whatever got's init containers.
func requestAndGateOnly(orig, got *corev1.Pod) error {
	c := requestcases.Case{Pod: orig, Want: requestcases.Gains}
	return errors.Join(c.Check(got), c.CheckReadinessGate(got))
}

// notMutated: got is as orig was submitted, as far as inpod is concerned.
func notMutated(orig, got *corev1.Pod) error {
	c := requestcases.Case{Pod: orig, Want: requestcases.Unchanged}
	return errors.Join(c.CheckNotRequested(got), c.CheckNoReadinessGate(got), waitReady(orig, got, false))
}

func waitReady(orig, got *corev1.Pod, enrolled bool) error {
	if msg := checkWaitReady(orig, got, enrolled); msg != "" {
		return errors.New(msg)
	}
	return nil
}

// startRequestWebhook serves inpod-controller's webhook in this process as
// TestIntegrationResourceRequestWebhook does (a default install's request
// and readiness gate, over TLS on localhost) until the benchmark ends, and
// returns the chart's MutatingWebhookConfiguration pointed at it. The
// webhook reads Namespaces with the admin's client: its identity changes
// nothing on a create's path, where the namespace comes from its informer.
func (a *apiserver) startRequestWebhook(b *testing.B) *unstructured.Unstructured {
	b.Helper()
	certDir := b.TempDir()
	ca := requestcases.WriteServingCert(b, certDir, 1)
	objs := render(b, "--set", "enrollment.autoRequest.mode=webhook", "--set", "controller.enabled=true",
		"--set", "enrollment.autoRequest.webhook.caBundle="+base64.StdEncoding.EncodeToString(ca))
	addr, _ := serveRequestWebhook(b, context.Background(), a.Client, certDir)
	mwcs := kinds(objs, "MutatingWebhookConfiguration")
	if len(mwcs) != 1 {
		b.Fatalf("%d MutatingWebhookConfigurations rendered", len(mwcs))
	}
	pointWebhooksAt(b, mwcs[0], addr)
	mwc := mwcs[0]
	return mwc
}

// remove deletes objs, as create created them.
func (a *apiserver) remove(tb testing.TB, objs ...*unstructured.Unstructured) {
	tb.Helper()
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			tb.Fatalf("%s %s: %v", gvk, o.GetName(), err)
		}
		var ri dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = a.dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		if err := ri.Delete(context.Background(), o.GetName(), metav1.DeleteOptions{}); err != nil {
			tb.Fatalf("delete %s %s: %v", gvk.Kind, o.GetName(), err)
		}
	}
}

// serverTimes is the API server's account of where pod creates spent
// their time: its CPU, and the sum and count of the latency histograms of
// pod creates, of the admission steps and of each admission plugin and
// webhook.
type serverTimes struct {
	cpu    time.Duration // process_cpu_seconds_total
	series map[string]histogramSum
}

type histogramSum struct {
	order      int // in serverSeries
	sum, count float64
}

// serverSeries names, for each histogram read, the series kept and how
// they are called in the log.
var serverSeries = []struct {
	metric string
	keep   func(labels map[string]string) (string, bool)
}{
	{"apiserver_request_duration_seconds", func(l map[string]string) (string, bool) {
		return "pod create", l["verb"] == "POST" && l["resource"] == "pods" && l["subresource"] == "" && l["dry_run"] == ""
	}},
	{"apiserver_admission_step_admission_duration_seconds", func(l map[string]string) (string, bool) {
		return "admission " + l["type"] + " step", l["operation"] == "CREATE"
	}},
	{"apiserver_admission_controller_admission_duration_seconds", func(l map[string]string) (string, bool) {
		return "plugin " + l["name"] + " (" + l["type"] + ")", l["operation"] == "CREATE"
	}},
	{"apiserver_admission_webhook_admission_duration_seconds", func(l map[string]string) (string, bool) {
		return "webhook " + l["name"], l["operation"] == "CREATE"
	}},
}

var labelPair = regexp.MustCompile(`(\w+)="([^"]*)"`)

func (a *apiserver) serverTimes(tb testing.TB) serverTimes {
	tb.Helper()
	raw, err := a.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	st := serverTimes{series: map[string]histogramSum{}}
	for line := range strings.Lines(string(raw)) {
		series, value, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok || strings.HasPrefix(series, "#") {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			tb.Fatalf("/metrics: %q: %v", line, err)
		}
		if series == "process_cpu_seconds_total" {
			st.cpu = time.Duration(v * float64(time.Second))
			continue
		}
		name, labels, _ := strings.Cut(series, "{")
		for i, s := range serverSeries {
			field, ok := strings.CutPrefix(name, s.metric+"_")
			if !ok || (field != "sum" && field != "count") {
				continue
			}
			l := map[string]string{}
			for _, m := range labelPair.FindAllStringSubmatch(labels, -1) {
				l[m[1]] = m[2]
			}
			key, keep := s.keep(l)
			if !keep {
				continue
			}
			h := st.series[key]
			h.order = i
			if field == "sum" {
				h.sum += v
			} else {
				h.count += v
			}
			st.series[key] = h
		}
	}
	return st
}

// perCreate is what the API server spent per pod create since before (a
// stream of creates creates): its CPU, then each series' time in the order
// of serverSeries, with its calls when that is not one a create (a
// mutation has the mutating plugins run again). Series under 10 µs a
// create are left out: most of the API server's plugins have nothing to do
// for these pods.
func (st serverTimes) perCreate(before serverTimes, creates int) string {
	out := []string{fmt.Sprintf("CPU %s", ((st.cpu - before.cpu) / time.Duration(creates)).Round(10*time.Microsecond))}
	keys := slices.SortedFunc(maps.Keys(st.series), func(x, y string) int {
		return cmp.Or(cmp.Compare(st.series[x].order, st.series[y].order), strings.Compare(x, y))
	})
	for _, k := range keys {
		now, was := st.series[k], before.series[k]
		calls := (now.count - was.count) / float64(creates)
		took := time.Duration((now.sum - was.sum) / float64(creates) * float64(time.Second)).Round(10 * time.Microsecond)
		if took == 0 {
			continue
		}
		if calls == 1 {
			out = append(out, fmt.Sprintf("%s %s", k, took))
		} else {
			out = append(out, fmt.Sprintf("%s %s (%.2f calls)", k, took, calls))
		}
	}
	return strings.Join(out, "; ")
}

// cpuTime is the CPU this process has used: the stream's client and, in
// webhook mode, the webhook.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
