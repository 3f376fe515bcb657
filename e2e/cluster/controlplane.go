// Package cluster runs a real Kubernetes for inpod's integration and
// end-to-end tests without Docker: etcd and kube-apiserver with a self-made
// PKI (ControlPlane), and optionally a full single node with
// controller-manager, scheduler, containerd, the kubelet and the reference
// CNI plugins (Node). Binaries come from `make k8s-bins`.
//
// Every process is started and stopped by pid and lives under one state
// root; starting first clears what a killed earlier run left there.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// BinDirEnv names the directory holding the Kubernetes and etcd binaries;
// the Makefile sets it from `make k8s-bins`.
const BinDirEnv = "INPOD_K8S_BIN_DIR"

// Config says where the binaries are and where state goes.
type Config struct {
	// BinDir holds etcd, kube-apiserver, … (default: $INPOD_K8S_BIN_DIR).
	BinDir string
	// Root is the state root; everything the cluster writes is under it
	// (default /var/lib/inpod-e2e). Leftovers there are cleared at start.
	Root string
	// NodeIP is the address the node reports (default: the address of the
	// interface holding the default route).
	NodeIP string
	// APIServerArgs are added to kube-apiserver's command line (e.g.
	// --enable-admission-plugins NodeRestriction).
	APIServerArgs []string
}

func (c *Config) defaults() error {
	if c.BinDir == "" {
		c.BinDir = os.Getenv(BinDirEnv)
	}
	if c.BinDir == "" {
		return fmt.Errorf("cluster: no binaries: set %s (make k8s-bins prints it)", BinDirEnv)
	}
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(c.BinDir, b)); err != nil {
			return fmt.Errorf("cluster: %s not in %s: run make k8s-bins", b, c.BinDir)
		}
	}
	if c.Root == "" {
		c.Root = "/var/lib/inpod-e2e"
	}
	if c.NodeIP == "" {
		ip, err := primaryIP()
		if err != nil {
			return err
		}
		c.NodeIP = ip
	}
	return nil
}

// ControlPlane is etcd plus kube-apiserver.
type ControlPlane struct {
	cfg     Config
	pki     *pki
	procs   []*process
	apiPort int
	// apiserverArgs are added to kube-apiserver's command line.
	apiserverArgs []string
	apiArgs       []string
	Kubeconfig    string // admin kubeconfig
	Rest          *rest.Config
	Client        kubernetes.Interface
}

// StartControlPlane brings up etcd and kube-apiserver and waits until the
// apiserver is ready. Stop it with Stop.
func StartControlPlane(ctx context.Context, cfg Config) (*ControlPlane, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if err := clearLeftovers(cfg.Root); err != nil {
		return nil, err
	}
	// Without a controller-manager nobody creates service accounts, so the
	// admission plugin that demands them would refuse every pod.
	cp := &ControlPlane{cfg: cfg, apiserverArgs: []string{"--disable-admission-plugins", "ServiceAccount"}}
	if err := cp.start(ctx); err != nil {
		cp.Stop()
		return nil, err
	}
	return cp, nil
}

func (cp *ControlPlane) start(ctx context.Context) error {
	root := cp.cfg.Root
	var err error
	if cp.pki, err = newPKI(filepath.Join(root, "pki")); err != nil {
		return err
	}
	nodeIP := net.ParseIP(cp.cfg.NodeIP)
	if err := cp.pki.issue("apiserver", "kube-apiserver", nil, true,
		[]net.IP{net.ParseIP("127.0.0.1"), nodeIP, net.ParseIP(serviceIP)},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"}); err != nil {
		return err
	}
	for _, c := range []struct{ name, cn, org string }{
		{"admin", "inpod-e2e-admin", "system:masters"},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"},
		{"controller-manager", "system:kube-controller-manager", ""},
		{"scheduler", "system:kube-scheduler", ""},
	} {
		var orgs []string
		if c.org != "" {
			orgs = []string{c.org}
		}
		if err := cp.pki.issue(c.name, c.cn, orgs, false, nil, nil); err != nil {
			return err
		}
	}
	if err := cp.pki.serviceAccountKeys(); err != nil {
		return err
	}

	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	etcd, err := startProcess(root, "etcd", filepath.Join(cp.cfg.BinDir, "etcd"), []string{
		"--data-dir", filepath.Join(root, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", "http://127.0.0.1:" + strconv.Itoa(ports[1]),
		"--initial-advertise-peer-urls", "http://127.0.0.1:" + strconv.Itoa(ports[1]),
		"--initial-cluster", "default=http://127.0.0.1:" + strconv.Itoa(ports[1]),
		"--unsafe-no-fsync", "--log-level", "warn",
	}, nil)
	if err != nil {
		return err
	}
	cp.procs = append(cp.procs, etcd)

	cp.apiPort = ports[2]
	p := cp.pki.path
	cp.apiArgs = append([]string{
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1",
		"--secure-port", strconv.Itoa(cp.apiPort),
		"--advertise-address", cp.cfg.NodeIP,
		"--cert-dir", filepath.Join(root, "pki"),
		"--tls-cert-file", p("apiserver.crt"), "--tls-private-key-file", p("apiserver.key"),
		"--client-ca-file", p("ca.crt"),
		"--kubelet-client-certificate", p("apiserver-kubelet-client.crt"),
		"--kubelet-client-key", p("apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types", "InternalIP,Hostname",
		"--service-account-key-file", p("sa.pub"),
		"--service-account-signing-key-file", p("sa.key"),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-cluster-ip-range", serviceCIDR,
		"--authorization-mode", "Node,RBAC",
		"--allow-privileged=true",
		"--enable-priority-and-fairness=false",
	}, append(cp.apiserverArgs, cp.cfg.APIServerArgs...)...)
	if err := cp.startAPIServer(); err != nil {
		return err
	}

	cp.Kubeconfig = filepath.Join(root, "admin.kubeconfig")
	if err := cp.writeKubeconfig(cp.Kubeconfig, "admin"); err != nil {
		return err
	}
	if cp.Rest, err = clientcmd.BuildConfigFromFlags("", cp.Kubeconfig); err != nil {
		return err
	}
	if cp.Client, err = kubernetes.NewForConfig(cp.Rest); err != nil {
		return err
	}
	return cp.waitAPIServer(ctx)
}

func (cp *ControlPlane) startAPIServer() error {
	api, err := startProcess(cp.cfg.Root, "kube-apiserver", filepath.Join(cp.cfg.BinDir, "kube-apiserver"), cp.apiArgs, nil)
	if err != nil {
		return err
	}
	cp.procs = append(cp.procs, api)
	return nil
}

// StopAPIServer stops only kube-apiserver (etcd and the rest keep running),
// to test behaviour through an API outage.
func (cp *ControlPlane) StopAPIServer() {
	for i, p := range cp.procs {
		if p.name == "kube-apiserver" {
			p.stop(10 * time.Second)
			cp.procs = append(cp.procs[:i], cp.procs[i+1:]...)
			return
		}
	}
}

// StartAPIServer starts kube-apiserver again on the same port and waits
// until it is ready.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	if err := cp.startAPIServer(); err != nil {
		return err
	}
	return cp.waitAPIServer(ctx)
}

func (cp *ControlPlane) waitAPIServer(ctx context.Context) error {
	return poll(60*time.Second, "kube-apiserver /readyz", func() (bool, error) {
		for _, pr := range cp.procs {
			if err := pr.running(); err != nil {
				return false, err
			}
		}
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil && string(body) == "ok", err
	})
}

// serviceCIDR is a range reserved for benchmarking (RFC 2544), so no
// cluster address can collide with a real network; serviceIP is its first
// address, the apiserver's "kubernetes" service.
const (
	serviceCIDR = "198.18.128.0/24"
	serviceIP   = "198.18.128.1"
)

// Server is the apiserver URL.
func (cp *ControlPlane) Server() string {
	return fmt.Sprintf("https://127.0.0.1:%d", cp.apiPort)
}

// writeKubeconfig writes a kubeconfig authenticating with the named client
// certificate of the PKI.
//
// The PKI goes in by value, not by path: client-go caches transports by CA
// and certificate file path, so a client of a control plane started over a
// killed run's root (same paths, new CA) would get the old run's transport
// and fail to verify the new apiserver.
func (cp *ControlPlane) writeKubeconfig(path, cert string) error {
	var ca, crt, key []byte
	for _, f := range []struct {
		name string
		data *[]byte
	}{{"ca.crt", &ca}, {cert + ".crt", &crt}, {cert + ".key", &key}} {
		var err error
		if *f.data, err = os.ReadFile(cp.pki.path(f.name)); err != nil {
			return err
		}
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["e2e"] = &clientcmdapi.Cluster{Server: cp.Server(), CertificateAuthorityData: ca}
	cfg.AuthInfos[cert] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	cfg.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: cert}
	cfg.CurrentContext = "e2e"
	return clientcmd.WriteToFile(*cfg, path)
}

// Stop stops every process in reverse order and removes the state root.
func (cp *ControlPlane) Stop() error {
	for i := len(cp.procs) - 1; i >= 0; i-- {
		cp.procs[i].stop(10 * time.Second)
	}
	cp.procs = nil
	return os.RemoveAll(cp.cfg.Root)
}

// Logs returns the tail of a component's log, for test failure messages.
func (cp *ControlPlane) Logs(name string, lines int) string {
	return tail(filepath.Join(cp.cfg.Root, "logs", name+".log"), lines)
}

// freePorts picks n ports free on every address, below the kernel's
// ephemeral range (32768 and up by default): a port the kernel hands out
// for :0 may be taken by an outgoing connection between the check and the
// component's bind (CI: kube-controller-manager "address already in use").
func freePorts(n int) ([]int, error) {
	var ports []int
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for attempt := 0; len(ports) < n; attempt++ {
		if attempt > 1000 {
			return nil, fmt.Errorf("cluster: no %d free ports in %d-%d", n, firstPort, lastPort)
		}
		port := firstPort + rand.IntN(lastPort-firstPort)
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			continue
		}
		lns = append(lns, l)
		ports = append(ports, port)
	}
	return ports, nil
}

// The range freePorts picks from.
const firstPort, lastPort = 20000, 32000

// primaryIP is the machine's own address: the one on the interface of the
// default route. The node registers with it; no traffic leaves the machine.
func primaryIP() (string, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	routes, err := os.ReadFile("/proc/net/route")
	if err != nil {
		return "", err
	}
	for _, line := range splitLines(string(routes))[1:] {
		var iface, dst string
		if _, err := fmt.Sscan(line, &iface, &dst); err != nil || dst != "00000000" {
			continue
		}
		for _, i := range ifaces {
			if i.Name != iface {
				continue
			}
			addrs, _ := i.Addrs()
			for _, a := range addrs {
				if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
					return ipn.IP.String(), nil
				}
			}
		}
	}
	return "", errors.New("cluster: no IPv4 address on the default-route interface; set Config.NodeIP")
}

// PID is the pid of a running component (etcd, kube-apiserver, kubelet, …),
// or 0.
func (cp *ControlPlane) PID(name string) int {
	for _, p := range cp.procs {
		if p.name == name {
			return p.cmd.Process.Pid
		}
	}
	return 0
}
