//go:build integration

package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/inpod-dev/inpod/netns/netnstest"
)

// execCNI runs the installed inpod-cni for one pod, as a runtime would, and
// returns how long the exec took from start to the plugin's exit.
func (w *world) execCNI(b *testing.B, command string, pod *corev1.Pod, sandbox *netnstest.NetNS, ip string) time.Duration {
	prev := fmt.Sprintf(`{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":%q}],"ips":[{"address":"%s/32","interface":0}]}`, sandbox.Path, ip)
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"podnet","type":"inpod-cni","agentSocket":%q,"timeout":"60s","prevResult":%s}`, w.cfg.CNISocket, prev)
	cmd := exec.Command(filepath.Join(w.binDir, "inpod-cni"))
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=c-" + pod.Name, "CNI_NETNS=" + sandbox.Path,
		"CNI_IFNAME=eth0", "CNI_PATH=" + w.binDir,
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + pod.Namespace + ";K8S_POD_NAME=" + pod.Name + ";K8S_POD_UID=" + string(pod.UID)}
	cmd.Stdin = strings.NewReader(conf)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Run(); err != nil {
		b.Errorf("inpod-cni %s for %s: %v: %s", command, pod.Name, err, out.String())
	}
	return time.Since(start)
}

func procField(pid int, field string) string {
	data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func openFDs(pid int) int {
	entries, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(entries)
}

// BenchmarkIntegrationEnrollment measures the agent (its own process,
// against a real apiserver, with the ztunnel stand-in binding real
// listeners): enrollment latency from the CNI exec to the plugin's exit
// (rules applied and ztunnel's ack included) for pods one at a time and 50
// at once; the agent's RSS with 250 enrolled pods; its open fds before and
// after 1,000 enroll/remove cycles. Run it with -benchtime 1x.
func BenchmarkIntegrationEnrollment(b *testing.B) {
	w := newWorld(b)
	bin := filepath.Join(b.TempDir(), "inpod-agent")
	if out, err := exec.Command("go", "build", "-o", bin, "../cmd/inpod-agent").CombinedOutput(); err != nil {
		b.Fatalf("build inpod-agent: %v: %s", err, out)
	}
	agentProc := w.startAgentProcess(bin)
	pid := agentProc.cmd.Process.Pid
	ctx := context.Background()

	const total = 250
	pods := make([]*corev1.Pod, total)
	sandboxes := make([]*netnstest.NetNS, total)
	for i := range total {
		pods[i], sandboxes[i] = w.pod("mesh", fmt.Sprintf("p%d", i))
	}
	w.eventually("the agent's cache", func() bool {
		list, _ := w.client.CoreV1().Pods("mesh").List(ctx, metav1.ListOptions{})
		return len(list.Items) == total
	})
	ip := func(i int) string { return fmt.Sprintf("198.18.%d.%d", 1+i/250, 1+i%250) }

	b.ResetTimer()
	var one []time.Duration
	for i := range 50 {
		one = append(one, w.execCNI(b, "ADD", pods[i], sandboxes[i], ip(i)))
	}
	many := make([]time.Duration, 50)
	var wg sync.WaitGroup
	for j := range 50 {
		i := 50 + j
		wg.Go(func() { many[j] = w.execCNI(b, "ADD", pods[i], sandboxes[i], ip(i)) })
	}
	wg.Wait()
	for i := 100; i < total; i++ {
		w.execCNI(b, "ADD", pods[i], sandboxes[i], ip(i))
	}
	b.StopTimer()
	w.eventually("250 workloads at ztunnel", func() bool { return len(w.standin.Workloads()) == total })
	rss := procField(pid, "VmRSS")

	// 1,000 enroll/remove cycles on one pod: every netns fd opened for an
	// ADD must be closed by its DEL.
	cyclePod, cycleNS := w.pod("mesh", "cycler")
	w.eventually("the cycler in the cache", func() bool {
		_, err := w.client.CoreV1().Pods("mesh").Get(ctx, "cycler", metav1.GetOptions{})
		return err == nil
	})
	w.execCNI(b, "ADD", cyclePod, cycleNS, "198.18.9.9")
	w.execCNI(b, "DEL", cyclePod, cycleNS, "198.18.9.9")
	fdsBefore := openFDs(pid)
	for range 1000 {
		w.execCNI(b, "ADD", cyclePod, cycleNS, "198.18.9.9")
		w.execCNI(b, "DEL", cyclePod, cycleNS, "198.18.9.9")
	}
	fdsAfter := openFDs(pid)
	if fdsAfter != fdsBefore {
		b.Errorf("open fds %d before and %d after 1,000 enroll/remove cycles", fdsBefore, fdsAfter)
	}

	stat := func(ds []time.Duration) (float64, float64) {
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000, float64(s[(len(s)-1)*99/100].Microseconds()) / 1000
	}
	p50, p99 := stat(one)
	b.ReportMetric(p50, "1-at-a-time-p50-ms")
	b.ReportMetric(p99, "1-at-a-time-p99-ms")
	p50, p99 = stat(many)
	b.ReportMetric(p50, "50-at-once-p50-ms")
	b.ReportMetric(p99, "50-at-once-p99-ms")
	var kb float64
	fmt.Sscanf(rss, "%f", &kb)
	b.ReportMetric(kb/1024, "agent-RSS-250-pods-MiB")
	b.ReportMetric(float64(fdsBefore), "fds-before-cycles")
	b.ReportMetric(float64(fdsAfter), "fds-after-1000-cycles")
}
