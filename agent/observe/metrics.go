// Package observe is the agent's outward view: Prometheus metrics, the
// health endpoints, and Kubernetes events on pods.
package observe

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/readiness"
)

// Metrics are the agent's Prometheus series.
type Metrics struct {
	Registry          *prometheus.Registry
	enrollments       *prometheus.CounterVec
	failures          *prometheus.CounterVec
	removals          prometheus.Counter
	ranUnredirected   prometheus.Counter
	latency           *prometheus.HistogramVec
	ztunnelConns      prometheus.Gauge
	ready             prometheus.Gauge
	readyTransitions  prometheus.Counter
	cniRepairs        prometheus.Counter
	handovers         *prometheus.CounterVec
	gateRegistrations *prometheus.CounterVec
	gateHealthFlips   *prometheus.CounterVec
	gateCloses        *prometheus.HistogramVec
	conditionWrites   *prometheus.CounterVec
	conditionFailures prometheus.Counter
	slicePublishes    prometheus.Counter
	sliceTaintChanges *prometheus.CounterVec
	sliceLatency      prometheus.Histogram
	prepareRefusals   prometheus.Counter
	startupReleased   prometheus.Gauge
	verifications     prometheus.Counter
	verifyLatency     prometheus.Histogram
	repairs           *prometheus.CounterVec
	unproven          prometheus.Gauge
	podConditions     *prometheus.CounterVec

	mu        sync.Mutex
	published bool
	lastReady float64
	// tracked counts the pods the agent holds as enrolled (set once the
	// pipeline exists).
	tracked func() int
}

// NewMetrics registers every series.
func NewMetrics() *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry: r,
		enrollments: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_enrollments_total",
			Help: "Pods enrolled, by how the agent learned of them (cni, reconcile)."}, []string{"source"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_enrollment_failures_total",
			Help: "Failed enrollments, by reason."}, []string{"reason"}),
		ranUnredirected: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_pods_ran_unredirected_total",
			Help: "Enrolled pods an agent found at its start running in a sandbox with no redirection rules and no record of enrollment (Event RanUnredirected): they ran outside the mesh while no agent could act, until redirected in place"}),
		removals: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_unenrollments_total",
			Help: "Pods taken out of the mesh."}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "inpod_enrollment_duration_seconds",
			Help: "From the CNI event (or reconcile) to rules applied and ztunnel's ack.",
			// Up to a minute: a CNI ADD may take up to the agent's 55 s
			// request timeout on a node starting many pods at once, and
			// the tail is what tells whether it came close.
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 45, 60}}, []string{"source"}),
		ztunnelConns: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_ztunnel_connections",
			Help: "Live ZDS connections."}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_node_ready",
			Help: "1 while the node is ready for redirection (the gate's signal)."}),
		readyTransitions: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_node_ready_transitions_total",
			Help: "Changes of inpod_node_ready."}),
		cniRepairs: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_cni_repairs_total",
			Help: "Times the CNI configuration or binary had to be put back."}),
		handovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_agent_handovers_total",
			Help: "Hand-overs of the node's sockets between two agents on it, by this agent's role: taken (at its start, from the agent serving the node), given (to its successor; it then stops serving metrics)."}, []string{"role"}),
		gateRegistrations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_deviceplugin_registrations_total",
			Help: "Registrations with the kubelet (kind: first, again)."}, []string{"kind"}),
		gateHealthFlips: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_deviceplugin_health_changes_total",
			Help: "Changes of the advertised devices' health."}, []string{"to"}),
		gateCloses: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "inpod_deviceplugin_close_seconds",
			Help:    "How long the devices stayed Healthy after the node stopped being ready (or the agent began stopping) while the scheduler was stopped and the pods already bound were admitted, by result (closed; incomplete: the timeout or an API error ended it first, and the kubelet may refuse a pod bound just before; called-off: ready again, or the agent stopping, first).",
			Buckets: []float64{.25, .5, 1, 1.5, 2, 3, 5, 10}}, []string{"result"}),
		conditionWrites: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_node_condition_writes_total",
			Help: "Writes of the Node condition InPodRedirectionReady by the node-condition gate, by status (True, False)."}, []string{"status"}),
		conditionFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_node_condition_write_failures_total",
			Help: "Failed reads or writes of the Node condition (each is retried with backoff)."}),
		slicePublishes: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_dra_slice_publishes_total",
			Help: "Writes of the node's ResourceSlice by the DRA gate, as seen in the API."}),
		sliceTaintChanges: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_dra_taint_changes_total",
			Help: "Changes of the DRA device's taints, by what they now say (tainted, untainted)."}, []string{"to"}),
		sliceLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "inpod_dra_slice_write_seconds",
			Help:    "From a readiness change to the node's ResourceSlice saying so in the API.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}}),
		prepareRefusals: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_dra_prepare_refusals_total",
			Help: "Claims the DRA gate refused to prepare because the node was not ready."}),
		startupReleased: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_startup_memory_released_bytes",
			Help: "Page cache of the agent's binary it dropped once ready and quiet (--release-startup-memory); 0 until then."}),
		verifications: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_verifications_total",
			Help: "Rounds of the verifier, each re-proving every enrolled pod."}),
		verifyLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "inpod_verification_duration_seconds",
			Help:    "How long one round of the verifier took (all enrolled pods and the probe exemptions).",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_redirection_repairs_total",
			Help: "Losses of redirection the verifier found and repaired, by kind (sandbox, rules, ztunnel, listeners, probe-exemption; outside-mesh-rules: inpod's rules removed from a pod outside the mesh)."}, []string{"kind"}),
		unproven: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_pods_unproven",
			Help: "Enrolled pods whose redirection the last verification could not prove (their inpod.dev/redirected condition is False)."}),
	}
	m.podConditions = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "inpod_pod_condition_writes_total",
		Help: "Writes of pods' inpod.dev/redirected condition, by result (written, failed; each failure is retried with backoff). One per enrolled pod start, and one per change the verifier finds."}, []string{"result"})
	r.MustRegister(m.verifications, m.verifyLatency, m.repairs, m.unproven, m.podConditions)
	r.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "inpod_enrolled_pods",
		Help: "Pods the agent holds as enrolled (or held for a restore) now; a soak compares it with the pods that exist."}, m.trackedPods))
	r.MustRegister(m.startupReleased, m.slicePublishes, m.sliceTaintChanges, m.sliceLatency, m.prepareRefusals, m.gateRegistrations, m.gateHealthFlips, m.gateCloses, m.conditionWrites, m.conditionFailures, m.enrollments, m.failures, m.removals, m.ranUnredirected, m.latency, m.ztunnelConns, m.ready, m.readyTransitions, m.cniRepairs, m.handovers,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// PodConditions counts the pod condition writer's writes
// (podcondition.Observer).
func (m *Metrics) PodConditions() PodConditionWrites { return PodConditionWrites{m.podConditions} }

// PodConditionWrites implements podcondition.Observer.
type PodConditionWrites struct{ v *prometheus.CounterVec }

func (w PodConditionWrites) Written() { w.v.WithLabelValues("written").Inc() }
func (w PodConditionWrites) Failed()  { w.v.WithLabelValues("failed").Inc() }

// Verified implements enroll.VerifyObserver.
func (m *Metrics) Verified(took time.Duration) {
	m.verifications.Inc()
	m.verifyLatency.Observe(took.Seconds())
}

// Repaired implements enroll.VerifyObserver.
func (m *Metrics) Repaired(kind string) { m.repairs.WithLabelValues(kind).Inc() }

// Unproven implements enroll.VerifyObserver.
func (m *Metrics) Unproven(n int) { m.unproven.Set(float64(n)) }

// TrackEnrolled makes inpod_enrolled_pods read n.
func (m *Metrics) TrackEnrolled(n func() int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.tracked = n
}

func (m *Metrics) trackedPods() float64 {
	m.mu.Lock()
	n := m.tracked
	m.mu.Unlock()
	if n == nil {
		return 0
	}
	return float64(n())
}

// Enrolled implements enroll.Observer.
func (m *Metrics) Enrolled(source string, took time.Duration) {
	m.enrollments.WithLabelValues(source).Inc()
	m.latency.WithLabelValues(source).Observe(took.Seconds())
}

// Failed implements enroll.Observer.
func (m *Metrics) Failed(reason string) { m.failures.WithLabelValues(reason).Inc() }

// Removed implements enroll.Observer.
func (m *Metrics) Removed() { m.removals.Inc() }

// RanUnredirected implements enroll.Observer.
func (m *Metrics) RanUnredirected() { m.ranUnredirected.Inc() }

// ZtunnelConnections sets the connection gauge.
func (m *Metrics) ZtunnelConnections(n int) { m.ztunnelConns.Set(float64(n)) }

// Registered implements deviceplugin.Observer.
func (m *Metrics) Registered(again bool) {
	kind := "first"
	if again {
		kind = "again"
	}
	m.gateRegistrations.WithLabelValues(kind).Inc()
}

// HealthChanged implements deviceplugin.Observer.
func (m *Metrics) HealthChanged(healthy bool) {
	to := "Unhealthy"
	if healthy {
		to = "Healthy"
	}
	m.gateHealthFlips.WithLabelValues(to).Inc()
}

// SchedulingClosed implements deviceplugin.Observer.
func (m *Metrics) SchedulingClosed(took time.Duration, result string) {
	m.gateCloses.WithLabelValues(result).Observe(took.Seconds())
}

// ConditionWritten implements nodecondition.Observer.
func (m *Metrics) ConditionWritten(status corev1.ConditionStatus) {
	m.conditionWrites.WithLabelValues(string(status)).Inc()
}

// ConditionWriteFailed implements nodecondition.Observer.
func (m *Metrics) ConditionWriteFailed() { m.conditionFailures.Inc() }

// SlicePublished implements dra.Observer.
func (m *Metrics) SlicePublished() { m.slicePublishes.Inc() }

// TaintsChanged implements dra.Observer.
func (m *Metrics) TaintsChanged(tainted bool) {
	to := "untainted"
	if tainted {
		to = "tainted"
	}
	m.sliceTaintChanges.WithLabelValues(to).Inc()
}

// SliceWritten implements dra.Observer.
func (m *Metrics) SliceWritten(took time.Duration) { m.sliceLatency.Observe(took.Seconds()) }

// PrepareRefused implements dra.Observer.
func (m *Metrics) PrepareRefused() { m.prepareRefusals.Inc() }

// StartupMemoryReleased records the bytes of its binary's page cache the
// agent dropped once ready and quiet.
func (m *Metrics) StartupMemoryReleased(bytes int64) { m.startupReleased.Set(float64(bytes)) }

// HandedOver counts a hand-over this agent took part in (role: taken,
// given).
func (m *Metrics) HandedOver(role string) { m.handovers.WithLabelValues(role).Inc() }

// CNIRepaired counts a repair.
func (m *Metrics) CNIRepaired() { m.cniRepairs.Inc() }

// Readiness follows the aggregate; register it with Aggregate.OnChange,
// which calls it in order.
func (m *Metrics) Readiness(st readiness.State) {
	v := 0.0
	if st.Ready {
		v = 1
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.published && m.lastReady != v {
		m.readyTransitions.Inc()
	}
	m.published, m.lastReady = true, v
	m.ready.Set(v)
}

// Serve runs the health endpoints (healthAddr: /healthz, /readyz) and the
// metrics endpoint (metricsAddr: /metrics) until ctx ends. /readyz answers
// 503 naming the failing conditions while the node is not ready. With
// debugPprof the metrics listener also serves Go's profiles under
// /debug/pprof/ (heap, goroutines, CPU): off by default, since they expose
// the agent's internals to anyone who reaches the node's port.
func Serve(ctx context.Context, log *slog.Logger, healthAddr, metricsAddr string, m *Metrics, ready *readiness.Aggregate, debugPprof bool) error {
	health := http.NewServeMux()
	health.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	health.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		st := ready.State()
		if !st.Ready {
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte("not ready:\n  " + strings.Join(st.Failing, "\n  ") + "\n"))
			return
		}
		w.Write([]byte("ready\n"))
	})
	metrics := http.NewServeMux()
	// Uncompressed: the page is a few KiB, and each gzip writer promhttp
	// pools is ~0.9 MiB, a third of the agent's live heap in a heap
	// profile taken after scrapes.
	metrics.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{DisableCompression: true}))
	if debugPprof {
		metrics.HandleFunc("/debug/pprof/", pprof.Index)
		metrics.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		metrics.HandleFunc("/debug/pprof/profile", pprof.Profile)
		metrics.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		metrics.HandleFunc("/debug/pprof/trace", pprof.Trace)
		log.Warn("serving Go profiles on the metrics address (--debug-pprof)", "path", "/debug/pprof/")
	}
	errc := make(chan error, 2)
	var servers []*http.Server
	for _, s := range []struct {
		addr string
		mux  *http.ServeMux
	}{{healthAddr, health}, {metricsAddr, metrics}} {
		if s.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: s.mux, ReadHeaderTimeout: 5 * time.Second}
		servers = append(servers, srv)
		log.Info("serving", "addr", ln.Addr().String())
		go func() { errc <- srv.Serve(ln) }()
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
	}
	for _, s := range servers {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		s.Shutdown(sctx)
		cancel()
	}
	return nil
}
