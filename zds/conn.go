package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/zds/zdspb"
)

// inFlight is the request on the wire: where its Ack goes, and whether the
// Ack also hands the turn on (a request sent through do, not the snapshot's
// roundTrip, whose sender keeps the turn for the whole snapshot).
type inFlight struct {
	ackc   chan *zdspb.Ack
	handOn bool
	// What its Ack tells about the pods this connection holds (see
	// acked.go): the request's op and uid, whether it carried a netns, and
	// void, set (under conn.mu) by a Del of that uid called while it is in
	// flight.
	op        string
	uid       string
	withNetNS bool
	void      bool
}

// request is one message awaiting one Ack.
type request struct {
	op      string // for logs and errors: add, del, keep, snapshot
	uid     string
	payload []byte
	netns   *os.File // sent as SCM_RIGHTS; only on add
}

// conn is one ztunnel connection. A request is sent, and its Ack awaited,
// by the goroutine that asks for it while it holds the connection's turn;
// readLoop owns the read side, hands each Ack straight to that goroutine and
// passes the turn on. The turn going from one send only to the Ack that
// settles it (or the connection's end) is what keeps one request in flight,
// and so the pairing of acks.
type conn struct {
	id         uint64
	uc         *net.UnixConn
	ackTimeout time.Duration
	log        *slog.Logger

	// turn holds the one token that lets its holder send. It starts
	// empty, the snapshot's, and gets the token once the snapshot is
	// acknowledged; a waiter also watches done, so nothing is stranded
	// when the connection dies.
	turn chan struct{}
	done chan struct{}

	mu       sync.Mutex
	waiting  *inFlight // non-nil while a request is in flight
	closeErr error
	// acked holds the uids of the pods whose Add, with a netns, this
	// connection acknowledged without error and no Del has named since
	// (see acked.go). Guarded by mu, which also guards the pairing of
	// each Ack with its request, so the two never disagree.
	acked map[string]struct{}

	// snapshotAcked is guarded by Server.mu.
	snapshotAcked bool
}

func newConn(id uint64, uc *net.UnixConn, ackTimeout time.Duration, log *slog.Logger) *conn {
	return &conn{
		id:         id,
		uc:         uc,
		ackTimeout: ackTimeout,
		log:        log,
		turn:       make(chan struct{}, 1),
		done:       make(chan struct{}),
		acked:      map[string]struct{}{},
	}
}

// fail closes the connection once, remembering the first reason.
func (c *conn) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closeErr != nil {
		return
	}
	if err == nil {
		err = errors.New("closed")
	}
	c.closeErr = err
	close(c.done)
	c.uc.Close()
}

func (c *conn) closeReason() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closeErr
}

// do waits for the connection's turn, sends r and waits for its Ack on the
// caller's goroutine: no hand-over to a connection goroutine on the way out
// or back. The turn goes on with the Ack: readLoop passes it to the next
// waiter as it delivers the Ack, so in a burst the next request goes out
// without waiting for this caller to be scheduled first (on a busy node
// each wake-up is milliseconds, paid once per Add on the one connection).
// A caller whose ctx ends while its request is on the wire returns at once;
// the request keeps the turn until its Ack or the connection's end settles
// it, so no later request is paired with that Ack.
func (c *conn) do(ctx context.Context, r *request) error {
	if r.op == "del" {
		// Before anything can fail: a Del, whatever becomes of it,
		// ends what Acked says of the pod here.
		c.forget(r.uid)
	}
	select {
	case <-c.turn:
	case <-c.done:
		return fmt.Errorf("%w (%s of pod %s)", ErrConnectionClosed, r.op, r.uid)
	case <-ctx.Done():
		return ctx.Err()
	}
	if err := ctx.Err(); err != nil {
		c.release()
		return err
	}
	ackc, err := c.send(r, true)
	if err != nil {
		if !errors.Is(err, errTurnHandedOn) {
			c.release() // nothing in flight: the turn is still ours
		}
		return err
	}
	// From here the turn is settled with the request: readLoop hands it on
	// with the Ack, and a timeout or a closed connection ends the
	// connection, whose waiters all watch done.
	timer := time.NewTimer(c.ackTimeout)
	settled, err := c.await(ctx.Done(), r, ackc, timer)
	if !settled {
		go c.await(nil, r, ackc, timer)
		return ctx.Err()
	}
	return err
}

func (c *conn) release() { c.turn <- struct{}{} }

// run sends the snapshot, opens the turn to requests, and waits for the
// connection to end. A returned error is the reason to close.
func (c *conn) run(ctx context.Context, src PodSource, snapshotAcked func()) error {
	if err := c.sendSnapshot(ctx, src); err != nil {
		return err
	}
	snapshotAcked()
	c.release()
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return errors.New("server shutting down")
	}
}

func isAckError(err error) bool {
	var ae *AckError
	return errors.As(err, &ae)
}

func (c *conn) sendSnapshot(ctx context.Context, src PodSource) error {
	workloads, err := src.Snapshot(ctx)
	// The snapshot's files are ours (see PodSource): each is closed once
	// sent, and whatever is left when the snapshot ends early.
	defer closeNetNS(workloads)
	if err != nil {
		return fmt.Errorf("zds: build snapshot: %w", err)
	}
	var adds, keeps, rejected, skipped int
	for _, w := range workloads {
		r, err := snapshotRequest(w)
		if err != nil {
			// One pod whose names do not fit must not keep ztunnel from
			// hearing about every other pod.
			c.log.Error("leaving pod out of the snapshot", "pod", w.UID, "err", err)
			continue
		}
		err = c.roundTrip(r)
		if w.NetNS != nil {
			w.NetNS.Close()
		}
		switch {
		case isAckError(err):
			// ztunnel retries a failed proxy start by itself.
			rejected++
			c.log.Warn("ztunnel rejected a snapshot entry", "err", err)
		case errors.Is(err, ErrNetNSClosed):
			// Only a source that closed what it handed over gets here.
			// Dropping the connection would cost every pod and the
			// readiness gate, and the next snapshot would race again.
			skipped++
			c.log.Warn("leaving pod out of the snapshot", "err", err)
		case err != nil:
			return err
		case r.op == "add":
			adds++
		default:
			keeps++
		}
	}
	msg, err := Marshal(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}})
	if err != nil {
		return err
	}
	if err := c.roundTrip(&request{op: "snapshot", payload: msg}); err != nil {
		return fmt.Errorf("zds: snapshot not acknowledged: %w", err)
	}
	c.log.Info("snapshot acknowledged", "adds", adds, "keeps", keeps, "rejected", rejected, "skipped", skipped)
	return nil
}

func closeNetNS(ws []Workload) {
	for _, w := range ws {
		if w.NetNS != nil {
			w.NetNS.Close() // a second Close only returns os.ErrClosed
		}
	}
}

func snapshotRequest(w Workload) (*request, error) {
	if w.NetNS != nil {
		msg, err := addRequest(w)
		if err != nil {
			return nil, err
		}
		return &request{op: "add", uid: w.UID, payload: msg, netns: w.NetNS}, nil
	}
	if w.UID == "" || len(w.UID) > maxUIDLen {
		return nil, fmt.Errorf("zds: invalid uid %q", w.UID)
	}
	msg, err := Marshal(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: w.UID}}})
	if err != nil {
		return nil, err
	}
	return &request{op: "keep", uid: w.UID, payload: msg}, nil
}

// roundTrip sends r and waits for its Ack; the caller holds the turn. Any
// error other than *AckError or ErrNetNSClosed leaves the connection unusable
// and closed.
func (c *conn) roundTrip(r *request) error {
	ackc, err := c.send(r, false)
	if err != nil {
		return err
	}
	_, err = c.await(nil, r, ackc, time.NewTimer(c.ackTimeout))
	return err
}

// errTurnHandedOn: a failed send whose request readLoop had already
// settled with an Ack (one the peer sent unasked) and whose turn it handed
// on; the caller must not give the turn back a second time.
var errTurnHandedOn = errors.New("an ack came for a request that was never sent")

// send puts r in flight and writes it; the caller holds the turn, which
// r's Ack hands on when handOn. On error nothing is in flight.
func (c *conn) send(r *request, handOn bool) (chan *zdspb.Ack, error) {
	ackc := make(chan *zdspb.Ack, 1)
	c.mu.Lock()
	if c.closeErr != nil {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w (%s of pod %s)", ErrConnectionClosed, r.op, r.uid)
	}
	c.waiting = &inFlight{ackc: ackc, handOn: handOn, op: r.op, uid: r.uid, withNetNS: r.netns != nil}
	c.mu.Unlock()

	if err := c.write(r); err != nil {
		if !c.settle(ackc) {
			// readLoop paired an Ack with a request that did not go out,
			// and released the turn for it: the peer acks what it was
			// never sent, so no pairing on this connection can be trusted.
			err := fmt.Errorf("protocol error: %w (%s of pod %s)", errTurnHandedOn, r.op, r.uid)
			c.log.Error("dropping ztunnel connection", "err", err)
			c.fail(err)
			return nil, fmt.Errorf("%w: %w", ErrConnectionClosed, err)
		}
		if errors.Is(err, ErrNetNSClosed) {
			// Nothing was written: the connection's pairing is intact.
			return nil, fmt.Errorf("%w: %s of pod %s (%s)", ErrNetNSClosed, r.op, r.uid, r.netns.Name())
		}
		err = fmt.Errorf("zds: send %s of pod %s: %w", r.op, r.uid, err)
		c.fail(err)
		if isPeerGone(err) {
			return nil, fmt.Errorf("%w: %v", ErrConnectionClosed, err)
		}
		return nil, err
	}
	return ackc, nil
}

// settle marks nothing in flight if the request in flight is still the one
// whose Ack goes to ackc, and says whether it was: readLoop may have settled
// it already, and the turn may since have gone on to the next request.
func (c *conn) settle(ackc chan *zdspb.Ack) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.waiting == nil || c.waiting.ackc != ackc {
		return false
	}
	c.waiting = nil
	return true
}

// await waits for the Ack of the request in flight, the connection's end,
// or the ack timeout (which closes the connection). settled is false when
// stop fired first: the request is still in flight and the caller must
// await it again before giving up the turn.
func (c *conn) await(stop <-chan struct{}, r *request, ackc chan *zdspb.Ack, timer *time.Timer) (settled bool, err error) {
	select {
	case ack := <-ackc:
		timer.Stop()
		return true, ackResult(r, ack)
	case <-c.done:
		timer.Stop()
		c.settle(ackc)
		return true, fmt.Errorf("%w (%s of pod %s): %v", ErrConnectionClosed, r.op, r.uid, c.closeReason())
	case <-timer.C:
		// An agent descheduled past the deadline wakes with both ready,
		// and select picks at random: an Ack already read is in time.
		select {
		case ack := <-ackc:
			return true, ackResult(r, ack)
		default:
		}
		err := fmt.Errorf("%w after %s (%s of pod %s); connection closed", ErrAckTimeout, c.ackTimeout, r.op, r.uid)
		c.fail(err)
		c.settle(ackc)
		return true, err
	case <-stop:
		return false, nil
	}
}

func ackResult(r *request, ack *zdspb.Ack) error {
	if ack.GetError() != "" {
		return &AckError{Op: r.op, UID: r.uid, Msg: ack.GetError()}
	}
	return nil
}

func (c *conn) write(r *request) error {
	if err := c.uc.SetWriteDeadline(time.Now().Add(c.ackTimeout)); err != nil {
		return err
	}
	if r.netns == nil {
		_, _, err := c.uc.WriteMsgUnix(r.payload, nil, nil)
		return err
	}
	// Control keeps the fd number valid for the duration of the send, so a
	// concurrent Close by the owner can never make us pass a recycled fd.
	rc, err := r.netns.SyscallConn()
	if err != nil {
		return ErrNetNSClosed
	}
	var sendErr error
	if err := rc.Control(func(fd uintptr) {
		_, _, sendErr = c.uc.WriteMsgUnix(r.payload, unix.UnixRights(int(fd)), nil)
	}); err != nil {
		return ErrNetNSClosed
	}
	return sendErr
}

// readLoop delivers each Ack to the request in flight. Anything else, an Ack
// with nothing in flight, or a read error ends the connection.
func (c *conn) readLoop() {
	for {
		d, err := ReadDatagram(c.uc)
		if err != nil {
			if isPeerGone(err) {
				c.fail(fmt.Errorf("peer went away: %w", err))
			} else {
				c.fail(fmt.Errorf("read: %w", err))
			}
			return
		}
		if len(d.FDs) > 0 {
			d.CloseFDs()
			c.log.Error("dropping ztunnel connection: response carried file descriptors")
			c.fail(errors.New("protocol error: response carried file descriptors"))
			return
		}
		ack, err := DecodeResponse(d.Payload)
		if err != nil {
			c.log.Error("dropping ztunnel connection: undecodable message", "err", err, "bytes", len(d.Payload))
			c.fail(fmt.Errorf("protocol error: %w", err))
			return
		}
		c.mu.Lock()
		req := c.waiting
		c.waiting = nil
		if req != nil {
			c.noteAckLocked(req, ack)
		}
		c.mu.Unlock()
		if req == nil {
			c.log.Error("dropping ztunnel connection: ack with no request in flight")
			c.fail(errors.New("protocol error: unsolicited ack"))
			return
		}
		// The Ack first, then the turn: the next sender is readied last,
		// so it runs before the caller that gets the Ack.
		req.ackc <- ack
		if req.handOn {
			c.release()
		}
	}
}
