// Package zdstest is a test peer that plays Istio's ztunnel on the ZDS wire
// and in the kernel. It is not a proxy.
//
// It connects to the agent's socket, says hello, and checks every message the
// way ztunnel does: an fd only on Add and exactly one there, that fd a network
// namespace, Keep only inside the snapshot, a single SnapshotSent, an Add
// naming its workload. A violation is recorded (ProtocolErrors) and ends the
// connection, as it ends ztunnel's in-pod mode. For each Add it enters the
// pod's netns and binds real TCP listeners on ztunnel's ports, marked with
// ztunnel's SO_MARK, and acks only once they listen; a Del closes them. Each
// listener answers a connection with one line naming the port, the original
// destination (SO_ORIGINAL_DST) and the peer, then closes it, so tests can see
// where redirected traffic landed.
package zdstest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
	"github.com/inpod-dev/inpod/zds/zdspb"
)

// ztunnel's in-pod ports and socket mark.
const (
	PortOutbound = 15001
	PortInbound  = 15006
	PortHBONE    = 15008
	PortDNS      = 15053
	Mark         = 0x539
)

// Config configures a Standin.
type Config struct {
	SocketPath string
	// DNS also binds 15053 (TCP and UDP), as ztunnel does with DNS capture.
	DNS bool
	// MinBackoff and MaxBackoff bound the reconnect delay.
	MinBackoff, MaxBackoff time.Duration
	// Fault injection for tests: AckDelay holds back the Ack of every Add
	// (a slow proxy start); Reject, when it returns non-empty, answers that
	// Add with an error Ack.
	AckDelay time.Duration
	Reject   func(uid string) string
	Logger   *slog.Logger
	// Record, when set, receives one JSON line (a RecordEntry) per
	// change of the stand-in's workloads: its start, every Add it
	// acknowledged (its listeners bound, written just before the Ack goes
	// out), every workload it closed. A
	// test replays it to judge the stand-in from outside its process.
	Record io.Writer
}

// RecordEntry is one line of Config.Record. Event is "start" (a new
// process: no workloads), "ack" (an Add acknowledged for UID in NetNS),
// "del" (the workload closed: a Del, or not named in a snapshot) or "stop"
// (Run ended, on SIGTERM in the command: every workload closes).
type RecordEntry struct {
	Time  time.Time `json:"time"`
	Event string    `json:"event"`
	UID   string    `json:"uid,omitempty"`
	Pod   string    `json:"pod,omitempty"`
	NetNS string    `json:"netns,omitempty"`
}

// Workload is what the stand-in runs for one pod.
type Workload struct {
	UID, Name, Namespace, ServiceAccount string
	NetNS                                netns.Identity
}

// Accepted is one connection a listener answered.
type Accepted struct {
	UID      string
	Port     int
	OrigDst  string
	Peer     string
	Received time.Time
}

// Standin is the fake ztunnel.
type Standin struct {
	cfg Config
	log *slog.Logger

	mu             sync.Mutex
	workloads      map[string]*workload
	connected      bool
	snapshotDone   bool
	connects       int
	protocolErrors []error
	accepted       []Accepted

	acceptor *acceptor // set by Run
}

type workload struct {
	info      Workload
	netns     *os.File
	listeners []closer
}

type closer interface{ Close() error }

// New returns a stand-in; Run connects it.
func New(cfg Config) *Standin {
	if cfg.SocketPath == "" {
		cfg.SocketPath = zds.DefaultSocketPath
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 50 * time.Millisecond
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 5 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Standin{cfg: cfg, log: log.With("component", "ztunnel-standin"), workloads: map[string]*workload{}}
}

// Run keeps a connection to the agent until ctx ends, reconnecting with
// exponential backoff. Workloads outlive connections, as ztunnel's proxies
// outlive an agent restart; Run's end closes them all.
func (z *Standin) Run(ctx context.Context) error {
	acc, err := newAcceptor(z.answer)
	if err != nil {
		return err
	}
	z.acceptor = acc
	defer acc.stop() // after the workloads' listeners are closed
	defer func() {
		// Before the listeners close: a judge reading the record sees the
		// stand-in go (its pod deleted, as an upgrade's old ztunnel is)
		// no later than the pods lose them.
		z.record(RecordEntry{Event: "stop"})
		z.closeAll()
	}()
	z.record(RecordEntry{Event: "start"})
	backoff := z.cfg.MinBackoff
	for {
		err := z.sessionOnOwnThread(ctx)
		if ctx.Err() != nil {
			return nil
		}
		z.log.Info("disconnected from agent; reconnecting", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, z.cfg.MaxBackoff)
		if err == nil {
			backoff = z.cfg.MinBackoff
		}
	}
}

// sessionOnOwnThread runs one connection on a goroutine of its own, which
// ends with it: a thread its netns switch could not bring back dies with that
// goroutine (see nsSwitch.in).
func (z *Standin) sessionOnOwnThread(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() {
		sw, err := newNSSwitch()
		if err != nil {
			errc <- err
			return
		}
		defer sw.close()
		errc <- z.session(ctx, sw)
	}()
	return <-errc
}

func (z *Standin) session(ctx context.Context, sw *nsSwitch) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", z.cfg.SocketPath)
	if err != nil {
		return err
	}
	uc := c.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	defer uc.Close()

	hello, _ := proto.Marshal(&zdspb.ZdsHello{Version: zdspb.Version_V1})
	if _, err := uc.Write(hello); err != nil {
		return fmt.Errorf("send hello: %w", err)
	}
	z.mu.Lock()
	z.connected = true
	z.snapshotDone = false
	z.connects++
	z.mu.Unlock()
	defer func() {
		z.mu.Lock()
		z.connected = false
		z.mu.Unlock()
	}()

	named := map[string]bool{} // uids the current snapshot named
	for {
		d, err := zds.ReadDatagram(uc)
		if err != nil {
			if errors.Is(err, zds.ErrTruncated) {
				return z.protocolError(err)
			}
			return err
		}
		ackErr, isAdd, started, perr := z.handle(sw, d, named)
		if perr != nil {
			return z.protocolError(perr)
		}
		if sw.poisoned() {
			// The thread is stuck in a pod netns: end the connection
			// (ztunnel would fail too) and let the thread die.
			return errors.New("could not return the stand-in's thread to its own netns")
		}
		if isAdd && z.cfg.AckDelay > 0 {
			select { // fault injection: a slow proxy start
			case <-ctx.Done():
				return nil
			case <-time.After(z.cfg.AckDelay):
			}
		}
		// Recorded before the Ack goes out: a SIGKILL between the two
		// would otherwise lose the line for an Ack the agent got, and a
		// pod that runs with ztunnel's listeners would look unacknowledged.
		// The converse is harmless: an Ack recorded but never sent fails
		// the agent's Add, so no sandbox runs on it.
		if isAdd && ackErr == "" {
			z.recordAck(d)
		}
		resp, _ := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: ackErr}}})
		_, err = uc.Write(resp)
		// Accepting starts after the Ack: the listeners are bound and
		// listening before it (what the Ack promises), so the kernel
		// already queues connections; registering them first would only
		// delay the Ack.
		if started != nil {
			z.serveAll(started)
		}
		if err != nil {
			return fmt.Errorf("send ack: %w", err)
		}
	}
}

// recordAck records the acknowledged Add in d (its workload as it runs
// now).
func (z *Standin) recordAck(d zds.Datagram) {
	if z.cfg.Record == nil {
		return
	}
	var req zdspb.WorkloadRequest
	if proto.Unmarshal(d.Payload, &req) != nil {
		return
	}
	uid := req.GetAdd().GetUid()
	z.mu.Lock()
	w := z.workloads[uid]
	z.mu.Unlock()
	if w != nil {
		z.record(RecordEntry{Event: "ack", UID: uid, Pod: w.info.Namespace + "/" + w.info.Name, NetNS: w.info.NetNS.String()})
	}
}

func (z *Standin) record(e RecordEntry) {
	if z.cfg.Record == nil {
		return
	}
	e.Time = time.Now()
	line, _ := json.Marshal(e)
	z.mu.Lock()
	defer z.mu.Unlock()
	z.cfg.Record.Write(append(line, '\n'))
}

func (z *Standin) protocolError(err error) error {
	z.log.Error("ZDS protocol error; leaving in-pod mode for this connection", "err", err)
	z.mu.Lock()
	z.protocolErrors = append(z.protocolErrors, err)
	z.mu.Unlock()
	return err
}

// handle applies one request. ackErr is the Ack's error text (a failure for
// that workload only); perr is a protocol violation that ends the connection.
// started is a workload whose listeners were just bound, to be served once
// its Ack is out.
func (z *Standin) handle(sw *nsSwitch, d zds.Datagram, named map[string]bool) (ackErr string, isAdd bool, started *workload, perr error) {
	var req zdspb.WorkloadRequest
	if err := proto.Unmarshal(d.Payload, &req); err != nil {
		d.CloseFDs()
		return "", false, nil, fmt.Errorf("undecodable WorkloadRequest: %w", err)
	}
	_, isAdd = req.Payload.(*zdspb.WorkloadRequest_Add)
	ackErr, started, perr = z.apply(sw, &req, d, named)
	return ackErr, isAdd, started, perr
}

func (z *Standin) apply(sw *nsSwitch, req *zdspb.WorkloadRequest, d zds.Datagram, named map[string]bool) (ackErr string, started *workload, perr error) {
	z.mu.Lock()
	snapshotDone := z.snapshotDone
	z.mu.Unlock()

	if _, isAdd := req.Payload.(*zdspb.WorkloadRequest_Add); !isAdd && len(d.FDs) > 0 {
		d.CloseFDs()
		return "", nil, fmt.Errorf("%T carried %d fds; only Add may carry one", req.Payload, len(d.FDs))
	}
	switch p := req.Payload.(type) {
	case *zdspb.WorkloadRequest_Add:
		if len(d.FDs) != 1 {
			d.CloseFDs()
			return "", nil, fmt.Errorf("add of %s carried %d fds, want exactly 1", p.Add.GetUid(), len(d.FDs))
		}
		if err := netns.CheckFD(d.FDs[0]); err != nil {
			d.CloseFDs()
			return "", nil, fmt.Errorf("add of %s: fd is not a network namespace: %w", p.Add.GetUid(), err)
		}
		z.log.Info("add received", "uid", p.Add.GetUid())
		ns := os.NewFile(uintptr(d.FDs[0]), "netns:"+p.Add.GetUid())
		if !snapshotDone {
			named[p.Add.GetUid()] = true
		}
		if p.Add.GetWorkloadInfo() == nil {
			ns.Close()
			return "workload_info is required", nil, nil
		}
		if msg := z.reject(p.Add.GetUid()); msg != "" {
			ns.Close()
			return msg, nil, nil
		}
		w, err := z.add(sw, p.Add, ns)
		if err != nil {
			return err.Error(), nil, nil
		}
		return "", w, nil
	case *zdspb.WorkloadRequest_Keep:
		if snapshotDone {
			return "", nil, fmt.Errorf("keep of %s after SnapshotSent", p.Keep.GetUid())
		}
		named[p.Keep.GetUid()] = true
		return "", nil, nil
	case *zdspb.WorkloadRequest_SnapshotSent:
		if snapshotDone {
			return "", nil, errors.New("second SnapshotSent on one connection")
		}
		z.dropUnnamed(named)
		z.mu.Lock()
		z.snapshotDone = true
		z.mu.Unlock()
		return "", nil, nil
	case *zdspb.WorkloadRequest_Del:
		z.del(p.Del.GetUid())
		return "", nil, nil
	default:
		return "", nil, fmt.Errorf("WorkloadRequest with no known payload (%d bytes)", len(d.Payload))
	}
}

func (z *Standin) reject(uid string) string {
	if z.cfg.Reject == nil {
		return ""
	}
	return z.cfg.Reject(uid)
}

// add starts (or keeps) the workload's listeners and returns the workload
// whose listeners it bound (nil when it kept the running one). An Add for a
// running uid with the same netns changes nothing; a different netns means
// the sandbox was recreated, so the listeners move.
func (z *Standin) add(sw *nsSwitch, a *zdspb.AddWorkload, ns *os.File) (*workload, error) {
	id, err := netns.IdentityOf(int(ns.Fd()))
	if err != nil {
		ns.Close()
		return nil, err
	}
	z.mu.Lock()
	old := z.workloads[a.GetUid()]
	z.mu.Unlock()
	if old != nil && old.info.NetNS == id {
		ns.Close()
		return nil, nil
	}
	w := &workload{
		info: Workload{
			UID:            a.GetUid(),
			Name:           a.GetWorkloadInfo().GetName(),
			Namespace:      a.GetWorkloadInfo().GetNamespace(),
			ServiceAccount: a.GetWorkloadInfo().GetServiceAccount(),
			NetNS:          id,
		},
		netns: ns,
	}
	if err := z.listen(sw, w); err != nil {
		w.close()
		return nil, fmt.Errorf("start proxy for %s: %w", a.GetUid(), err)
	}
	z.mu.Lock()
	z.workloads[a.GetUid()] = w
	z.mu.Unlock()
	if old != nil {
		old.close()
	}
	z.log.Info("workload added", "uid", a.GetUid(), "pod", w.info.Namespace+"/"+w.info.Name, "netns", id)
	return w, nil
}

func (z *Standin) del(uid string) {
	z.mu.Lock()
	w := z.workloads[uid]
	delete(z.workloads, uid)
	z.mu.Unlock()
	if w != nil {
		w.close()
		z.record(RecordEntry{Event: "del", UID: uid})
		z.log.Info("workload deleted", "uid", uid)
	}
}

func (z *Standin) dropUnnamed(named map[string]bool) {
	z.mu.Lock()
	var drop []*workload
	for uid, w := range z.workloads {
		if !named[uid] {
			drop = append(drop, w)
			delete(z.workloads, uid)
		}
	}
	z.mu.Unlock()
	for _, w := range drop {
		z.log.Info("workload not in snapshot; dropped", "uid", w.info.UID)
		w.close()
		z.record(RecordEntry{Event: "del", UID: w.info.UID})
	}
}

func (z *Standin) closeAll() {
	z.mu.Lock()
	ws := z.workloads
	z.workloads = map[string]*workload{}
	z.mu.Unlock()
	for _, w := range ws {
		w.close()
	}
}

func (w *workload) close() {
	for _, l := range w.listeners {
		l.Close()
	}
	w.listeners = nil
	w.netns.Close()
}

// Connected reports whether a connection is up and past its hello.
func (z *Standin) Connected() bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.connected
}

// SnapshotDone reports whether the current connection's snapshot has ended.
func (z *Standin) SnapshotDone() bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.connected && z.snapshotDone
}

// Connects counts the connections made so far.
func (z *Standin) Connects() int {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.connects
}

// Workloads lists the running workloads by uid.
func (z *Standin) Workloads() map[string]Workload {
	z.mu.Lock()
	defer z.mu.Unlock()
	out := make(map[string]Workload, len(z.workloads))
	for uid, w := range z.workloads {
		out[uid] = w.info
	}
	return out
}

// ProtocolErrors lists every protocol violation seen.
func (z *Standin) ProtocolErrors() []error {
	z.mu.Lock()
	defer z.mu.Unlock()
	return append([]error(nil), z.protocolErrors...)
}

// AcceptedConns lists the connections the listeners answered.
func (z *Standin) AcceptedConns() []Accepted {
	z.mu.Lock()
	defer z.mu.Unlock()
	return append([]Accepted(nil), z.accepted...)
}
