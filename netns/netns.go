// Package netns runs code inside another network namespace without letting
// the switch leak into the caller's thread, and identifies namespace fds.
//
// setns(2) changes only the calling OS thread, and the Go runtime moves
// goroutines between threads, so every switch happens on a goroutine locked to
// its thread. When the thread cannot be switched back it stays locked, and the
// runtime discards it when the goroutine exits instead of reusing a thread that
// sits in the wrong namespace.
package netns

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// nsGetNSType is NS_GET_NSTYPE from <linux/nsfs.h>: _IO(0xb7, 0x3).
const nsGetNSType = 0xb703

// ErrNotNetNS reports an fd that refers to something other than a network
// namespace (another namespace type, or a plain file).
var ErrNotNetNS = errors.New("not a network namespace")

// Do runs fn on a dedicated OS thread that has joined the network namespace
// ns. fn must not start goroutines that expect to inherit the namespace.
func Do(ns *os.File, fn func() error) error {
	if err := Check(ns); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := homeNetNS()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open current netns: %w", err)
			return
		}
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %s: %w", ns.Name(), err)
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: it dies with this goroutine.
			errc <- errors.Join(fnErr, fmt.Errorf("restore netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- fnErr
	}()
	return <-errc
}

// home is the namespace of the threads the runtime schedules goroutines on
// freely: every thread Do switches is switched back to it or discarded, so
// a new goroutine's thread is in it. It is opened once: reading a thread's
// namespace from procfs costs more than both switches together, and the
// verifier enters every pod's netns. Opened at init, on the main thread
// before any code could switch a thread: opened by the first Do instead, it
// would be the namespace of whatever thread ran that Do, and a thread some
// library left in a pod's namespace (one that unlocks a thread it failed to
// switch back) would make every later Do "restore" threads into that pod.
var home struct {
	mu sync.Mutex
	ns *os.File
}

func init() {
	// A failure (no procfs yet, no fd) leaves it to the first Do.
	if f, err := os.Open(threadNetNSPath()); err == nil {
		home.ns = f
	}
}

func homeNetNS() (*os.File, error) {
	home.mu.Lock()
	defer home.mu.Unlock()
	if home.ns == nil { // a failed open (out of fds) is tried again next time
		f, err := os.Open(threadNetNSPath())
		if err != nil {
			return nil, err
		}
		home.ns = f
	}
	return home.ns, nil
}

// DoPath is Do for a namespace named by a path such as /var/run/netns/x or
// /proc/<pid>/ns/net.
func DoPath(path string, fn func() error) error {
	ns, err := Open(path)
	if err != nil {
		return err
	}
	defer ns.Close()
	return Do(ns, fn)
}

// Open opens path and checks that it is a network namespace.
func Open(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	if err := Check(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Check verifies that f refers to a network namespace, the same test ztunnel
// applies to the fd it receives.
func Check(f *os.File) error {
	var checkErr error
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("netns %s: %w", f.Name(), err)
	}
	err = rc.Control(func(fd uintptr) { checkErr = CheckFD(int(fd)) })
	if err != nil {
		return fmt.Errorf("netns %s: %w", f.Name(), err)
	}
	if checkErr != nil {
		return fmt.Errorf("netns %s: %w", f.Name(), checkErr)
	}
	return nil
}

// CheckFD is Check for a raw fd, as received over SCM_RIGHTS.
func CheckFD(fd int) error {
	kind, err := unix.IoctlRetInt(fd, nsGetNSType)
	if err != nil {
		if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) {
			return ErrNotNetNS
		}
		return fmt.Errorf("NS_GET_NSTYPE: %w", err)
	}
	if kind != unix.CLONE_NEWNET {
		return ErrNotNetNS
	}
	return nil
}

// Identity is what makes two namespace fds the same namespace: the nsfs
// inode and device, which ztunnel compares to tell a recreated sandbox from a
// repeated Add.
type Identity struct {
	Dev uint64
	Ino uint64
}

// IdentityOf returns the identity of the namespace behind fd.
func IdentityOf(fd int) (Identity, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Identity{}, fmt.Errorf("fstat netns: %w", err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}, nil
}

// IdentityOfPath is IdentityOf for a namespace named by a path
// (/var/run/netns/x, /proc/<pid>/ns/net): stat follows the bind mount or
// magic link to the nsfs inode, so nothing needs to be opened.
func IdentityOfPath(path string) (Identity, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Identity{}, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return Identity{Dev: st.Dev, Ino: st.Ino}, nil
}

func (id Identity) String() string { return fmt.Sprintf("%d:%d", id.Dev, id.Ino) }

func threadNetNSPath() string {
	return fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
}
