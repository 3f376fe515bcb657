package zds

import "github.com/inpod-dev/inpod/zds/zdspb"

// Acked reports whether the newest connection, the one Add sends to, has
// acknowledged without error an Add of the pod uid carrying its netns (in
// its snapshot or since) and no Del of uid has been asked of it since. It is
// false with no connection, and on a connection that has closed.
//
// It is for a verifier that re-proves every enrolled pod: ztunnel acks an
// Add only once its listeners exist in the pod, so true means the ztunnel
// that Add would talk to now took this pod on, on this connection. What an
// older connection, or an earlier ztunnel, acknowledged does not count: a new
// connection resets ztunnel's view, and during an upgrade the pods that
// matter are the ones the newest ztunnel runs.
//
// What counts, and why:
//   - An Add of the snapshot counts as soon as it is acknowledged, before the
//     snapshot's SnapshotSent is: its Ack already means the listeners exist,
//     and SnapshotSent drops only workloads the snapshot did not name. A Keep
//     never counts: it names a pod whose netns the agent did not hold, and
//     ztunnel starts nothing for it on this connection.
//   - An Ack with an error (AckError) does not count, and ends what an
//     earlier Ack of the same uid said: the Add that failed may have been for
//     a recreated sandbox, whose old proxy ztunnel replaces.
//   - A Del of uid ends it from the moment Del is called, whether the Del is
//     then sent, acknowledged, refused or abandoned, and it also voids an Add
//     of uid on the wire at that moment, whose Ack comes later. An Add sent
//     after the Del was called (the two raced) counts again once acknowledged:
//     on the wire it came last.
//   - An Add whose caller gave up (its context ended) counts once its Ack
//     comes: ztunnel took the pod on all the same.
//
// Acked answers from memory, with two mutexes and no I/O, so it is cheap to
// call for every pod. It does not compare netns: a pod whose sandbox was
// recreated is acked for as long as the Add of the old sandbox is, until an
// Add of the new one replaces it (or fails, which ends it).
func (s *Server) Acked(uid string) bool {
	s.mu.Lock()
	var newest *conn
	if n := len(s.conns); n > 0 {
		newest = s.conns[n-1]
	}
	s.mu.Unlock()
	return newest != nil && newest.holds(uid)
}

// holds says whether c acknowledged an Add of uid that still counts (see
// Server.Acked); a closed connection holds nothing.
func (c *conn) holds(uid string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closeErr != nil {
		return false
	}
	_, ok := c.acked[uid]
	return ok
}

// forget ends what c holds of uid, and voids an Add of uid in flight, whose
// Ack would otherwise bring it back: a Del was asked for.
func (c *conn) forget(uid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.acked, uid)
	if c.waiting != nil && c.waiting.uid == uid {
		c.waiting.void = true
	}
}

// noteAckLocked records what the Ack of req says about the pod it names. It
// runs in readLoop as the Ack is paired with its request, under c.mu: the
// pairing is where an Ack is known to belong to req, and one lock for both
// keeps one owner of this state. An Ack paired here with a request that then
// fails to go out (a peer acking what it was never sent) closes the
// connection (see send), and a closed connection holds nothing.
func (c *conn) noteAckLocked(req *inFlight, ack *zdspb.Ack) {
	switch req.op {
	case "add":
		if req.withNetNS && !req.void && ack.GetError() == "" {
			c.acked[req.uid] = struct{}{}
		} else {
			delete(c.acked, req.uid)
		}
	case "del":
		delete(c.acked, req.uid)
	}
}

// Settled reports whether the newest connection has acknowledged its
// snapshot: before that, a pod it has not acknowledged yet may simply not
// have come up in the snapshot (a ztunnel that just connected, or the new
// one of a rolling upgrade), which is no loss to repair.
func (s *Server) Settled() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.conns)
	return n > 0 && s.conns[n-1].snapshotAcked
}
