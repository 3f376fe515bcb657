package observe

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// PluginToken are the series of the token the agent keeps for the plugin's
// agent-down check. Alert on the expiry coming close: once it passes, every
// pod's ADD on the node fails while the agent is down.
type PluginToken struct {
	expires  prometheus.Gauge
	failures prometheus.Counter
}

// NewPluginToken registers the series with r.
func NewPluginToken(r prometheus.Registerer) *PluginToken {
	m := &PluginToken{
		expires: prometheus.NewGauge(prometheus.GaugeOpts{Name: "inpod_plugin_token_expiry_timestamp_seconds",
			Help: "When the token in the plugin's API access file expires (Unix time); 0 until the first renewal."}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Name: "inpod_plugin_token_renewal_failures_total",
			Help: "Failed requests for the plugin's token (the file keeps the previous one)."}),
	}
	r.MustRegister(m.expires, m.failures)
	return m
}

// PluginTokenRenewed records the new token's expiry.
func (m *PluginToken) PluginTokenRenewed(expires time.Time) {
	m.expires.Set(float64(expires.Unix()))
}

// PluginTokenRenewalFailed counts a failed renewal.
func (m *PluginToken) PluginTokenRenewalFailed() { m.failures.Inc() }
