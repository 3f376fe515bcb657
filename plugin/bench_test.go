package plugin_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/benchreport"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
	"github.com/inpod-dev/inpod/passlist"
	"github.com/inpod-dev/inpod/plugin"
	"github.com/inpod-dev/inpod/plugin/plugintest"
)

// startAgentProcess runs the agent's CNI event server in a process of its
// own, as on a node, answering "not enrolled", and its pass list listing
// the benchmark's pod.
func startAgentProcess(b *testing.B, dir, socket, passList string) {
	bin := filepath.Join(dir, "notenrolled")
	build := exec.Command("go", "build", "-o", bin, "./testdata/notenrolled")
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("build the agent stand-in: %v: %s", err, out)
	}
	cmd := exec.Command(bin, socket, passList, "default/bench", "u1")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	testkit.Eventually(b, 10*time.Second, "the agent stand-in to answer on "+socket, func() bool {
		_, err := cnievent.Send(context.Background(), socket, &cnievent.Request{Command: cnievent.Add})
		return err == nil && passlist.Passes(passList, "default", "bench", "u1")
	})
}

// execPlugin runs a CNI plugin binary the way a runtime does, inside node.
func execPlugin(b *testing.B, node *os.File, bin, command, podNetns, containerID string, stdin []byte) ([]byte, time.Duration) {
	var out, stderr bytes.Buffer
	var took time.Duration
	err := netns.Do(node, func() error {
		cmd := exec.Command(bin)
		cmd.Env = []string{
			"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + podNetns,
			"CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(bin),
			"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=bench;K8S_POD_UID=u1",
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(stdin), &out, &stderr
		start := time.Now()
		err := cmd.Run()
		took = time.Since(start)
		return err
	})
	if err != nil {
		b.Fatalf("%s %s: %v: %s %s", filepath.Base(bin), command, err, out.String(), stderr.String())
	}
	return out.Bytes(), took
}

// BenchmarkPassThroughAdd measures inpod-cni's ADD for a pod that is not
// enrolled, three ways: listed on the agent's pass list (the common case: the
// agent has seen the pod by the time its sandbox starts), not listed so the
// plugin asks the agent over its socket, and in an excluded namespace. Two
// baselines run in the same loop: a minimal Go program that only echoes
// prevResult (the exec floor) and the reference bridge plugin's ADD into a
// fresh pod netns.
func BenchmarkPassThroughAdd(b *testing.B) {
	dir := pluginDir(b)
	echo, err := plugintest.BuildEcho(dir)
	if err != nil {
		b.Fatal(err)
	}
	// pluginDir builds the binaries as shipped (make build): static, stripped.
	stripped := filepath.Join(dir, plugin.PluginType)
	fi, err := os.Stat(stripped)
	if err != nil {
		b.Fatal(err)
	}
	helper, err := os.Stat(filepath.Join(dir, cnievent.APICheckBinary))
	if err != nil {
		b.Fatal(err)
	}

	node := netnstest.New(b)
	nodeFile := node.Open(b)
	socket := filepath.Join(b.TempDir(), "cni.sock")
	passList := filepath.Join(b.TempDir(), "not-enrolled")
	startAgentProcess(b, dir, socket, passList)
	ipamDir := b.TempDir()
	bridgeConf, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "bench", "type": "bridge", "bridge": "bbr0",
		"ipam": map[string]any{"type": "host-local", "subnet": "198.51.100.0/24", "dataDir": ipamDir}})
	prev := []byte(`{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"address":"198.51.100.7/24","interface":0}]}`)
	listedConf := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"bench","type":"inpod-cni","agentSocket":%q,"passList":%q,"prevResult":%s}`, socket, passList, prev))
	// The same pod without the pass list: the plugin asks the agent.
	asksConf := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"bench","type":"inpod-cni","agentSocket":%q,"prevResult":%s}`, socket, prev))
	// The same pod in an excluded namespace: decided without the agent.
	excludedConf := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"bench","type":"inpod-cni","agentSocket":%q,"excludeNamespaces":["default"],"prevResult":%s}`, socket, prev))

	var echoT, listedT, asksT, excludedT, bridgeT []time.Duration
	runs := []func(i int){
		func(int) {
			_, d := execPlugin(b, nodeFile, echo, "ADD", "/var/run/netns/x", "c", listedConf)
			echoT = append(echoT, d)
		},
		func(int) {
			out, d := execPlugin(b, nodeFile, stripped, "ADD", "/var/run/netns/x", "c", listedConf)
			listedT = append(listedT, d)
			if !bytes.Equal(out, prev) {
				b.Fatalf("inpod-cni changed prevResult: %s", out)
			}
		},
		func(int) {
			out, d := execPlugin(b, nodeFile, stripped, "ADD", "/var/run/netns/x", "c", asksConf)
			asksT = append(asksT, d)
			if !bytes.Equal(out, prev) {
				b.Fatalf("inpod-cni changed prevResult: %s", out)
			}
		},
		func(int) {
			_, d := execPlugin(b, nodeFile, stripped, "ADD", "/var/run/netns/x", "c", excludedConf)
			excludedT = append(excludedT, d)
		},
		func(i int) {
			pod := netnstest.New(b)
			id := fmt.Sprintf("c%d", i)
			_, d := execPlugin(b, nodeFile, filepath.Join(dir, "bridge"), "ADD", pod.Path, id, bridgeConf)
			bridgeT = append(bridgeT, d)
			execPlugin(b, nodeFile, filepath.Join(dir, "bridge"), "DEL", pod.Path, id, bridgeConf)
		},
	}
	b.ResetTimer()
	for i := range b.N {
		// Rotated, so that no measurement always follows the bridge's
		// teardown, whose kernel work (veth and netns cleanup) goes on in
		// the background and slows whatever runs next.
		for j := range runs {
			runs[(i+j)%len(runs)](i)
		}
	}
	b.StopTimer()
	med := func(ds []time.Duration) float64 { return benchreport.Ms(benchreport.Percentile(ds, 50)) }
	b.ReportMetric(float64(fi.Size())/(1<<20), "inpod-cni-MiB")
	b.ReportMetric(float64(helper.Size())/(1<<20), "apicheck-MiB")
	b.ReportMetric(med(echoT), "echo-floor-ms")
	b.ReportMetric(med(listedT), "inpod-passthrough-ms")
	b.ReportMetric(med(asksT), "inpod-asks-agent-ms")
	b.ReportMetric(med(excludedT), "inpod-excluded-ms")
	b.ReportMetric(med(bridgeT), "bridge-add-ms")
	b.ReportMetric(med(listedT)/med(echoT), "inpod/floor-ratio")
	b.ReportMetric(med(asksT)/med(echoT), "inpod-asks-agent/floor-ratio")
	b.ReportMetric(med(excludedT)/med(echoT), "inpod-excluded/floor-ratio")
	b.ReportMetric(med(listedT)/med(bridgeT), "inpod/bridge-ratio")

	const section = "CNI plugin (static, stripped, as make build ships it)"
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "inpod-cni binary size", Value: float64(fi.Size()) / (1 << 20), Unit: "MiB", Target: "≤ 10 MiB"})
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "inpod-cni-apicheck binary size (exec'ed only while the agent is down)", Value: float64(helper.Size()) / (1 << 20), Unit: "MiB"})
	floor := "exec of a plugin that only echoes prevResult"
	for _, f := range []struct {
		name string
		ds   []time.Duration
	}{
		{"pass-through ADD, pod on the agent's pass list (median)", listedT},
		{"pass-through ADD, plugin asks the agent (median)", asksT},
		{"pass-through ADD, excluded namespace (median)", excludedT},
	} {
		benchreport.Record(b, benchreport.Figure{Section: section, Name: f.name, Value: med(f.ds), Unit: "ms",
			FloorName: floor, Floor: med(echoT), Target: "≤ 1.5× floor"})
	}
	benchreport.Record(b, benchreport.Figure{Section: section, Name: "reference bridge plugin ADD into a fresh netns (median)", Value: med(bridgeT), Unit: "ms",
		FloorName: floor, Floor: med(echoT)})
}
