package cluster

import (
	"fmt"
	"path/filepath"

	"github.com/inpod-dev/inpod/e2e/images"
)

// The node's configuration files, as the harness writes them.

// primaryConflist is the node's primary CNI network: bridge with
// host-local, then portmap.
func primaryConflist(ipamDir string) map[string]any {
	return map[string]any{
		"cniVersion": "1.0.0",
		"name":       NetworkName,
		"plugins": []any{
			map[string]any{
				"type": "bridge", "bridge": BridgeName, "isGateway": true, "ipMasq": false,
				"ipam": map[string]any{
					"type":    "host-local",
					"ranges":  [][]map[string]string{{{"subnet": PodCIDR}}},
					"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
					"dataDir": ipamDir,
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
}

// containerdConfig is containerd's config.toml for a node whose state lives
// under dir. restrict_oom_score_adj: without CAP_SYS_RESOURCE every sandbox
// would fail to start; cgroupfs: the machine has no systemd cgroup manager.
func containerdConfig(dir, socket, cniBin, cniConf string) string {
	return fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[4]q
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[5]q
    conf_dir = %[6]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), socket, images.PauseRef, cniBin, cniConf)
}

// kubeletConfig is the KubeletConfiguration of the node: cgroupfs, no swap
// or cgroup v1 refusal, eviction thresholds low enough for a small disk.
func kubeletConfig(containerd, nodeIP string, port, healthzPort int, clientCA string) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
failCgroupV1: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %q}
authorization: {mode: Webhook}
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: /etc/resolv.conf
nodeStatusUpdateFrequency: 10s
serializeImagePulls: false
`, containerd, nodeIP, port, healthzPort, clientCA)
}
