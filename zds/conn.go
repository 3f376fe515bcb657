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

// request is one message awaiting one Ack.
type request struct {
	op      string // for logs and errors: add, del, keep, snapshot
	uid     string
	payload []byte
	netns   *os.File // sent as SCM_RIGHTS; only on add
}

// conn is one ztunnel connection. Its run goroutine owns the write side and
// the in-flight slot; readLoop owns the read side.
type conn struct {
	id         uint64
	uc         *net.UnixConn
	ackTimeout time.Duration
	log        *slog.Logger

	// reqs is unbuffered: a request is handed over only when run is ready
	// to send it, so nothing can be stranded in a queue when the
	// connection dies.
	reqs chan requestCall
	done chan struct{}

	mu       sync.Mutex
	waiting  chan *zdspb.Ack // non-nil while a request is in flight
	closeErr error

	// snapshotAcked is guarded by Server.mu.
	snapshotAcked bool
}

type requestCall struct {
	ctx    context.Context
	req    *request
	result chan error
}

func newConn(id uint64, uc *net.UnixConn, ackTimeout time.Duration, log *slog.Logger) *conn {
	return &conn{
		id:         id,
		uc:         uc,
		ackTimeout: ackTimeout,
		log:        log,
		reqs:       make(chan requestCall),
		done:       make(chan struct{}),
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

// do hands r to the connection's goroutine and waits for the outcome.
func (c *conn) do(ctx context.Context, r *request) error {
	call := requestCall{ctx: ctx, req: r, result: make(chan error, 1)}
	select {
	case c.reqs <- call:
	case <-c.done:
		return fmt.Errorf("%w (%s of pod %s)", ErrConnectionClosed, r.op, r.uid)
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-call.result:
		return err
	case <-ctx.Done():
		// run still owns the request and will finish or time it out;
		// the pairing of acks is not affected by the caller leaving.
		return ctx.Err()
	}
}

// run sends the snapshot, then serves requests until the connection ends.
// A returned error is the reason to close.
func (c *conn) run(ctx context.Context, src PodSource, snapshotAcked func()) error {
	if err := c.sendSnapshot(ctx, src); err != nil {
		return err
	}
	snapshotAcked()
	for {
		select {
		case call := <-c.reqs:
			if err := call.ctx.Err(); err != nil {
				call.result <- err
				continue
			}
			err := c.roundTrip(call.req)
			call.result <- err
			if err != nil && !pairingIntact(err) {
				return err
			}
		case <-c.done:
			return nil
		case <-ctx.Done():
			return errors.New("server shutting down")
		}
	}
}

func isAckError(err error) bool {
	var ae *AckError
	return errors.As(err, &ae)
}

// pairingIntact reports a failure of one request that leaves the connection
// usable: ztunnel answered it with an error, or nothing was sent at all.
func pairingIntact(err error) bool {
	return isAckError(err) || errors.Is(err, ErrNetNSClosed)
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

// roundTrip sends r and waits for its Ack. Any error other than *AckError
// leaves the connection unusable and closed.
func (c *conn) roundTrip(r *request) error {
	ackc := make(chan *zdspb.Ack, 1)
	c.mu.Lock()
	if c.closeErr != nil {
		c.mu.Unlock()
		return fmt.Errorf("%w (%s of pod %s)", ErrConnectionClosed, r.op, r.uid)
	}
	c.waiting = ackc
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.waiting = nil
		c.mu.Unlock()
	}()

	if err := c.send(r); err != nil {
		if errors.Is(err, ErrNetNSClosed) {
			// Nothing was written: the connection's pairing is intact.
			return fmt.Errorf("%w: %s of pod %s (%s)", ErrNetNSClosed, r.op, r.uid, r.netns.Name())
		}
		err = fmt.Errorf("zds: send %s of pod %s: %w", r.op, r.uid, err)
		c.fail(err)
		if isPeerGone(err) {
			return fmt.Errorf("%w: %v", ErrConnectionClosed, err)
		}
		return err
	}
	timer := time.NewTimer(c.ackTimeout)
	defer timer.Stop()
	select {
	case ack := <-ackc:
		if ack.GetError() != "" {
			return &AckError{Op: r.op, UID: r.uid, Msg: ack.GetError()}
		}
		return nil
	case <-c.done:
		return fmt.Errorf("%w (%s of pod %s): %v", ErrConnectionClosed, r.op, r.uid, c.closeReason())
	case <-timer.C:
		err := fmt.Errorf("%w after %s (%s of pod %s); connection closed", ErrAckTimeout, c.ackTimeout, r.op, r.uid)
		c.fail(err)
		return err
	}
}

func (c *conn) send(r *request) error {
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
		ackc := c.waiting
		c.waiting = nil
		c.mu.Unlock()
		if ackc == nil {
			c.log.Error("dropping ztunnel connection: ack with no request in flight")
			c.fail(errors.New("protocol error: unsolicited ack"))
			return
		}
		ackc <- ack
	}
}
