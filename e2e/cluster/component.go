package cluster

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
)

// Component is a process started beside the control plane (kube-scheduler,
// inpod-controller, …) under its state root: Stop on the control plane
// stops it too, and a killed run's leftover is cleared at the next start.
type Component struct {
	p *process
}

// StartComponent starts bin with args under the control plane's root; its
// output goes to logs/<name>.log (Logs(name, n) reads it).
func (cp *ControlPlane) StartComponent(name, bin string, args, env []string) (*Component, error) {
	p, err := startProcess(cp.cfg.Root, name, bin, args, env)
	if err != nil {
		return nil, err
	}
	cp.procs = append(cp.procs, p)
	return &Component{p: p}, nil
}

// PID is the component's process id.
func (c *Component) PID() int { return c.p.cmd.Process.Pid }

// Running is nil while the component runs, else an error with its last log
// lines.
func (c *Component) Running() error { return c.p.running() }

// Stop sends SIGTERM and waits up to grace before SIGKILL.
func (c *Component) Stop(grace time.Duration) { c.p.stop(grace) }

// Kill ends it at once (SIGKILL to its process group), as a node failure
// or an OOM kill would, and waits for it to be reaped.
func (c *Component) Kill() {
	select {
	case <-c.p.exited:
	default:
		syscall.Kill(-c.p.cmd.Process.Pid, syscall.SIGKILL)
		<-c.p.exited
	}
	os.Remove(c.p.pidPath)
}

// SchedulerConfig tunes the kube-scheduler StartScheduler runs.
type SchedulerConfig struct {
	// QPS and Burst of its API client. The scheduler's default (50) caps
	// throughput at the client, not at the scheduler's own work, so
	// benchmarks of scheduling cost raise it as scheduler_perf does.
	QPS, Burst int
}

// Scheduler is a kube-scheduler started by StartScheduler.
type Scheduler struct {
	*Component
	// MetricsURL is its /metrics over HTTPS (self-signed serving
	// certificate; the admin client certificate authenticates).
	MetricsURL string
}

// StartScheduler runs kube-scheduler against the control plane (no
// leader election) and waits until it is healthy. For benchmarks that
// schedule onto Node objects with no kubelet behind them.
func (cp *ControlPlane) StartScheduler(ctx context.Context, cfg SchedulerConfig) (*Scheduler, error) {
	root := cp.cfg.Root
	kubeconfig := filepath.Join(root, "scheduler.kubeconfig")
	if err := cp.writeKubeconfig(kubeconfig, "scheduler"); err != nil {
		return nil, err
	}
	if cfg.QPS == 0 {
		cfg.QPS, cfg.Burst = 50, 100
	}
	config := filepath.Join(root, "scheduler-config.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %s
  qps: %d
  burst: %d
leaderElection:
  leaderElect: false
`, kubeconfig, cfg.QPS, cfg.Burst), 0o644); err != nil {
		return nil, err
	}
	ports, err := freePorts(1)
	if err != nil {
		return nil, err
	}
	c, err := cp.StartComponent("kube-scheduler", filepath.Join(cp.cfg.BinDir, "kube-scheduler"), []string{
		"--config", config,
		"--authentication-kubeconfig", kubeconfig,
		"--authorization-kubeconfig", kubeconfig,
		"--authorization-always-allow-paths", "/healthz,/readyz,/livez,/metrics,/debug/pprof/*",
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(ports[0]),
	}, nil)
	if err != nil {
		return nil, err
	}
	s := &Scheduler{Component: c, MetricsURL: fmt.Sprintf("https://127.0.0.1:%d/metrics", ports[0])}
	healthz := fmt.Sprintf("https://127.0.0.1:%d/healthz", ports[0])
	client, err := cp.ComponentHTTPClient()
	if err != nil {
		return nil, err
	}
	err = poll(60*time.Second, "kube-scheduler /healthz", func() (bool, error) {
		if err := c.Running(); err != nil {
			return false, fatal{err}
		}
		req, err := newGet(ctx, healthz)
		if err != nil {
			return false, fatal{err}
		}
		resp, err := client.Do(req)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == 200, nil
	})
	if err != nil {
		c.Stop(10 * time.Second)
		return nil, err
	}
	return s, nil
}

// ComponentHTTPClient is an HTTPS client for the components' own endpoints
// (/metrics, /healthz, /debug/pprof): it presents the admin client
// certificate and does not verify the component's self-signed serving
// certificate, which no CA of this harness issued. For tests only.
func (cp *ControlPlane) ComponentHTTPClient() (*http.Client, error) {
	tlsConfig, err := rest.TLSConfigFor(cp.Rest)
	if err != nil {
		return nil, err
	}
	tlsConfig.InsecureSkipVerify = true
	tlsConfig.RootCAs = nil
	return &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{TLSClientConfig: tlsConfig}}, nil
}

func newGet(ctx context.Context, url string) (*http.Request, error) {
	return http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
}
