package zdstest

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// acceptor answers the connections of every workload's TCP listeners from
// one goroutine blocked in epoll_wait. Serving a workload then costs one
// epoll_ctl per listener after its Ack. A goroutine and a net.Listener per
// listener (a dup, a second poller registration and a park each) cost
// ~100 µs of CPU right after every Ack, which on a 2-core node is the CPU
// the agent needs to read that Ack: it doubled the Add→Ack figure of issue
// 19 while being nothing ztunnel does.
type acceptor struct {
	epfd, wakefd int
	answer       func(uid string, port, fd int)

	mu     sync.Mutex
	socks  map[uint64]served // by epoll token; 0 is wakefd
	next   uint64
	closed bool
	done   chan struct{}
}

type served struct {
	uid string
	b   *boundSocket
}

func newAcceptor(answer func(uid string, port, fd int)) (*acceptor, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &unix.EpollEvent{Events: unix.EPOLLIN}); err != nil {
		unix.Close(epfd)
		unix.Close(wakefd)
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	a := &acceptor{epfd: epfd, wakefd: wakefd, answer: answer, socks: map[uint64]served{}, done: make(chan struct{})}
	go a.run()
	return a, nil
}

// serve starts answering b's connections, for workload uid.
func (a *acceptor) serve(uid string, b *boundSocket) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return errors.New("stand-in stopping")
	}
	a.next++
	token := a.next
	a.socks[token] = served{uid: uid, b: b}
	a.mu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fd < 0 {
		a.forget(token)
		return nil // deleted before it was served
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(uint32(token)), Pad: int32(uint32(token >> 32))}
	if err := unix.EpollCtl(a.epfd, unix.EPOLL_CTL_ADD, b.fd, &ev); err != nil {
		a.forget(token)
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	b.unserve = func() { a.forget(token) }
	return nil
}

func (a *acceptor) forget(token uint64) {
	a.mu.Lock()
	delete(a.socks, token)
	a.mu.Unlock()
}

func (a *acceptor) run() {
	defer close(a.done)
	events := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(a.epfd, events, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return
		}
		for _, ev := range events[:n] {
			token := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			if token == 0 {
				return
			}
			a.mu.Lock()
			s, ok := a.socks[token]
			a.mu.Unlock()
			if ok {
				a.acceptAll(s)
			}
		}
	}
}

// acceptAll accepts and answers every queued connection of s.
func (a *acceptor) acceptAll(s served) {
	var fds []int
	s.b.mu.Lock()
	for s.b.fd >= 0 {
		fd, _, err := unix.Accept4(s.b.fd, unix.SOCK_CLOEXEC)
		if err != nil {
			break // EAGAIN: drained; anything else: the next event retries
		}
		fds = append(fds, fd)
	}
	s.b.mu.Unlock()
	for _, fd := range fds {
		a.answer(s.uid, s.b.port, fd)
	}
}

// stop ends the loop; listeners are closed by their workloads.
func (a *acceptor) stop() {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	unix.Write(a.wakefd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	<-a.done
	unix.Close(a.epfd)
	unix.Close(a.wakefd)
}
