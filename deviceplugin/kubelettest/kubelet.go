// Package kubelettest is a stand-in for the kubelet's device manager, for
// testing device plugins without a node: it serves the registration socket,
// validates a registration as the kubelet does, dials the plugin back, reads
// its options, consumes ListAndWatch and keeps capacity and allocatable the
// way the device manager does (allocatable = healthy devices). It can restart
// like the kubelet: every socket in the directory deleted, kubelet.sock
// recreated, devices forgotten until the plugin registers again.
package kubelettest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// Kubelet is the stand-in.
type Kubelet struct {
	pluginapi.UnimplementedRegistrationServer
	Dir string

	mu            sync.Mutex
	srv           *grpc.Server
	resources     map[string]*resource
	registrations int
	updates       chan struct{}
}

type resource struct {
	endpoint string
	devices  map[string]string // id → health
	conn     *grpc.ClientConn
	cancel   context.CancelFunc
	options  *pluginapi.DevicePluginOptions
	// Received is when the latest ListAndWatch update arrived.
	received time.Time
	// history is every update's healthy count, in order of arrival.
	history []Update
}

// Update is one ListAndWatch update as received.
type Update struct {
	At          time.Time
	Allocatable int
}

// Start serves dir/kubelet.sock.
func Start(dir string) (*Kubelet, error) {
	k := &Kubelet{Dir: dir, resources: map[string]*resource{}, updates: make(chan struct{}, 1)}
	if err := k.serve(); err != nil {
		return nil, err
	}
	return k, nil
}

func (k *Kubelet) serve() error {
	if err := os.MkdirAll(k.Dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(k.Dir, "kubelet.sock")
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(srv, k)
	k.mu.Lock()
	k.srv = srv
	k.mu.Unlock()
	go srv.Serve(ln)
	return nil
}

// Register validates like the kubelet, then dials the plugin back.
func (k *Kubelet) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	if req.Version != pluginapi.Version {
		return nil, fmt.Errorf("unsupported device plugin API version %q", req.Version)
	}
	domain, name, ok := strings.Cut(req.ResourceName, "/")
	if !ok || domain == "" || name == "" || strings.Contains(name, "/") || domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") {
		return nil, fmt.Errorf("invalid extended resource name %q", req.ResourceName)
	}
	if req.Endpoint == "" || strings.Contains(req.Endpoint, "/") {
		return nil, fmt.Errorf("endpoint %q must be a socket name in %s", req.Endpoint, k.Dir)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.Dir, req.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	client := pluginapi.NewDevicePluginClient(conn)
	octx, ocancel := context.WithTimeout(ctx, 5*time.Second)
	defer ocancel()
	opts, err := client.GetDevicePluginOptions(octx, &pluginapi.Empty{})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("dial back %s: %w", req.Endpoint, err)
	}
	sctx, cancel := context.WithCancel(context.Background())
	stream, err := client.ListAndWatch(sctx, &pluginapi.Empty{})
	if err != nil {
		cancel()
		conn.Close()
		return nil, err
	}
	r := &resource{endpoint: req.Endpoint, devices: map[string]string{}, conn: conn, cancel: cancel, options: opts}
	k.mu.Lock()
	if old := k.resources[req.ResourceName]; old != nil {
		old.cancel()
		old.conn.Close()
	}
	k.resources[req.ResourceName] = r
	k.registrations++
	k.mu.Unlock()
	go k.consume(req.ResourceName, r, stream)
	return &pluginapi.Empty{}, nil
}

func (k *Kubelet) consume(name string, r *resource, stream grpc.ServerStreamingClient[pluginapi.ListAndWatchResponse]) {
	for {
		resp, err := stream.Recv()
		if err != nil {
			return
		}
		k.mu.Lock()
		if k.resources[name] == r {
			r.devices = map[string]string{}
			healthy := 0
			for _, d := range resp.Devices {
				r.devices[d.ID] = d.Health
				if d.Health == pluginapi.Healthy {
					healthy++
				}
			}
			r.received = time.Now()
			r.history = append(r.history, Update{At: r.received, Allocatable: healthy})
		}
		k.mu.Unlock()
		select {
		case k.updates <- struct{}{}:
		default:
		}
	}
}

// FirstSince returns the first update received at or after since whose
// healthy count is allocatable: unlike polling Allocatable, it sees a state
// that a later update already replaced.
func (k *Kubelet) FirstSince(name string, since time.Time, allocatable int) (Update, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if r := k.resources[name]; r != nil {
		for _, u := range r.history {
			if !u.At.Before(since) && u.Allocatable == allocatable {
				return u, true
			}
		}
	}
	return Update{}, false
}

// Updates signals (coalesced) that a ListAndWatch update arrived.
func (k *Kubelet) Updates() <-chan struct{} { return k.updates }

// Capacity is the number of devices the resource advertises.
func (k *Kubelet) Capacity(name string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if r := k.resources[name]; r != nil {
		return len(r.devices)
	}
	return 0
}

// Allocatable is the number of healthy devices.
func (k *Kubelet) Allocatable(name string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	if r := k.resources[name]; r != nil {
		for _, h := range r.devices {
			if h == pluginapi.Healthy {
				n++
			}
		}
	}
	return n
}

// Endpoint is the socket the resource is registered with.
func (k *Kubelet) Endpoint(name string) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if r := k.resources[name]; r != nil {
		return r.endpoint
	}
	return ""
}

// Registrations counts successful registrations.
func (k *Kubelet) Registrations() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.registrations
}

// Allocate asks the plugin for n devices of the resource, as the kubelet
// does when admitting a pod.
func (k *Kubelet) Allocate(ctx context.Context, name string, n int) (*pluginapi.AllocateResponse, error) {
	k.mu.Lock()
	r := k.resources[name]
	var ids []string
	if r != nil {
		for id := range r.devices {
			if len(ids) < n {
				ids = append(ids, id)
			}
		}
	}
	k.mu.Unlock()
	if r == nil {
		return nil, errors.New("resource not registered")
	}
	return pluginapi.NewDevicePluginClient(r.conn).Allocate(ctx, &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}},
	})
}

// PreStart is the kubelet's call before starting a container holding the
// devices ids: made only when the plugin registered with PreStartRequired
// (ok false otherwise), and its error keeps the container from starting.
func (k *Kubelet) PreStart(ctx context.Context, name string, ids []string) (ok bool, err error) {
	k.mu.Lock()
	r := k.resources[name]
	k.mu.Unlock()
	if r == nil {
		return false, errors.New("endpoint not found in cache for a registered resource: " + name)
	}
	if r.options == nil || !r.options.PreStartRequired {
		return false, nil
	}
	_, err = pluginapi.NewDevicePluginClient(r.conn).PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: ids})
	return true, err
}

// Restart behaves like a kubelet restart: the registration server stops,
// every socket in the directory is deleted, devices are forgotten, and a
// new kubelet.sock appears.
func (k *Kubelet) Restart() error {
	k.Stop()
	entries, _ := os.ReadDir(k.Dir)
	for _, e := range entries {
		if e.Type()&os.ModeSocket != 0 {
			os.Remove(filepath.Join(k.Dir, e.Name()))
		}
	}
	return k.serve()
}

// Stop stops the registration server and drops every plugin connection.
func (k *Kubelet) Stop() {
	k.mu.Lock()
	srv := k.srv
	for name, r := range k.resources {
		r.cancel()
		r.conn.Close()
		delete(k.resources, name)
	}
	k.mu.Unlock()
	if srv != nil {
		srv.Stop()
	}
}
