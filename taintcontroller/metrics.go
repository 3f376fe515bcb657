package taintcontroller

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Metrics are the controller's Prometheus series.
type Metrics struct {
	Registry        *prometheus.Registry
	removed         prometheus.Counter
	added           prometheus.Counter
	reconcileErrors prometheus.Counter
	untaintLatency  prometheus.Histogram
	leader          prometheus.Gauge
}

// NewMetrics registers every series.
func NewMetrics() *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry: r,
		removed: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_controller_taints_removed_total",
			Help: "Writes removing the startup taint from a node, or a previous one (--previous-taints), or both at once."}),
		added: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_controller_taints_added_total",
			Help: "Startup taints put back on nodes (continuous mode)."}),
		reconcileErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_controller_reconcile_errors_total",
			Help: "Failed reconciles of a node (retried with backoff)."}),
		untaintLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "inpod_controller_untaint_latency_seconds",
			Help:    "From the condition's lastTransitionTime to True (one-second resolution) to the startup taint removed (not observed for writes removing only a previous taint).",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300}}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_controller_leader",
			Help: "1 while this replica holds the Lease."}),
	}
	r.MustRegister(m.removed, m.added, m.reconcileErrors, m.untaintLatency, m.leader,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func validateTaintKey(key string) []string { return validation.IsQualifiedName(key) }

// serve runs /healthz, /readyz and /metrics until ctx ends. /healthz fails
// when this replica leads but has not renewed its Lease for a while (a
// stuck leader is restarted); /readyz is ok for a candidate and for a
// leader whose caches are synced.
func (c *Controller) serve(ctx context.Context) error {
	health := http.NewServeMux()
	health.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := c.healthz.Check(r); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write([]byte("ok\n"))
	})
	health.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if c.leading.Load() && !c.synced.Load() {
			http.Error(w, "leading, caches not synced yet", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	metrics := http.NewServeMux()
	metrics.Handle("/metrics", promhttp.HandlerFor(c.cfg.Metrics.Registry, promhttp.HandlerOpts{}))
	type srv struct {
		addr string
		mux  *http.ServeMux
	}
	var srvs []srv
	if c.cfg.HealthAddr != "" && c.cfg.HealthAddr == c.cfg.MetricsAddr {
		health.Handle("/metrics", metrics)
		srvs = append(srvs, srv{c.cfg.HealthAddr, health})
	} else {
		if c.cfg.HealthAddr != "" {
			srvs = append(srvs, srv{c.cfg.HealthAddr, health})
		}
		if c.cfg.MetricsAddr != "" {
			srvs = append(srvs, srv{c.cfg.MetricsAddr, metrics})
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, s := range srvs {
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return err
		}
		hs := &http.Server{Handler: s.mux, ReadHeaderTimeout: 5 * time.Second}
		g.Go(func() error {
			if err := hs.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
		g.Go(func() error {
			<-gctx.Done()
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			return hs.Shutdown(sctx)
		})
	}
	err := g.Wait()
	if err != nil && strings.Contains(err.Error(), "use of closed") {
		return nil
	}
	return err
}
