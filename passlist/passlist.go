// Package passlist is how the node agent tells inpod-cni, ahead of time,
// which pods on the node are not enrolled, so that their ADD passes without
// a round trip to the agent: a pod start waits on no other process unless
// the pod is in the mesh (or the agent has not classified it yet).
//
// The list is a root-only directory the agent keeps in step with its pod and
// namespace watches: one file per pod that is not enrolled, named
// "<namespace>.<name>" (a namespace has no dots) and holding the pod's UID.
// A pod with no file is asked about as before, so the list may lag or be
// empty without harm, except in one direction: a stale "not enrolled" would
// let an enrolled pod start unredirected. Hence:
//
//   - the agent removes a pod's file, under the same lock that writes it,
//     as soon as its watches show the pod enrolled;
//   - the file holds the UID, and a sandbox of another pod of that name is
//     not passed; nor is a sandbox whose runtime named no UID, since it may
//     be another pod's of that name (a StatefulSet's pod replaced while the
//     agent's watch lags, enrolled where the old one was not);
//   - each agent process writes its own generation of the list, a
//     directory "gen-<random>" holding the entries and a file ".lock" on
//     which the agent holds an open-file-description write lock
//     (F_OFD_SETLK) for its whole life. The kernel drops that lock when
//     the process dies, however it dies (SIGKILL, OOM kill, panic), and
//     only that agent ever locks that file, so "the lock is held" means
//     "the process that wrote these entries is alive". The plugin asks
//     with F_OFD_GETLK, which takes nothing and never waits on the agent;
//   - "current", a symlink the agent swaps atomically once its watches
//     have synced, names the generation the plugin reads. A new agent
//     never reads, empties or trusts another's entries, so a list being
//     rebuilt, or a killed agent's leftovers, are never taken for the live
//     agent's view;
//   - a live but stopped or wedged agent (SIGSTOP, a frozen cgroup) keeps
//     its lock, so the lock file's mtime is also a heartbeat, renewed every
//     HeartbeatInterval: the list is trusted only while it is younger than
//     MaxAge and not from the future (a clock set back proves nothing).
//
// The agent answers a live ADD from the same watches, so the list is as
// current as that answer, give or take the write.
package passlist

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/internal/atomicfile"
)

const (
	// HeartbeatInterval is how often the agent renews the list.
	HeartbeatInterval = 2 * time.Second
	// MaxAge is how old a heartbeat may be for the plugin to trust the
	// list: a few missed beats (a loaded node), then the plugin asks.
	MaxAge = 5 * HeartbeatInterval

	currentLink = "current"
	lockFile    = ".lock"
	genPrefix   = "gen-"
	// openLock serialises agents' Open (create, lock, clear out the dead)
	// so that one agent never removes a generation another is creating.
	openLock = ".open"
)

func entryName(namespace, name string) (string, bool) {
	if namespace == "" || name == "" || strings.ContainsAny(namespace, "./") || strings.Contains(name, "/") || name == "." || name == ".." {
		return "", false
	}
	return namespace + "." + name, true
}

// Passes reports whether the list in dir, as the live agent keeps it, says
// the pod is not enrolled. Any doubt (no UID from the runtime, no live
// agent holding the current generation's lock, an old or future heartbeat,
// no entry, another UID, an unreadable file) answers false: ask the agent.
func Passes(dir, namespace, name, uid string) bool {
	entry, ok := entryName(namespace, name)
	if !ok || uid == "" {
		return false
	}
	gen, err := os.Readlink(filepath.Join(dir, currentLink))
	if err != nil || !strings.HasPrefix(gen, genPrefix) || strings.Contains(gen, "/") {
		return false
	}
	have, err := os.ReadFile(filepath.Join(dir, gen, entry))
	if err != nil || string(have) != uid {
		return false
	}
	// Checked after reading the entry: the agent that wrote it was alive
	// and beating after the read, not only before it.
	return writerLive(filepath.Join(dir, gen, lockFile), time.Now())
}

// writerLive says whether the agent that owns lock is alive (holds its
// lock) and its heartbeat (the file's mtime) is at most MaxAge old at now.
func writerLive(lock string, now time.Time) bool {
	fd, err := unix.Open(lock, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	held, err := locked(fd)
	if err != nil || !held {
		return false
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false
	}
	age := now.Sub(time.Unix(st.Mtim.Unix()))
	return age >= 0 && age <= MaxAge
}

// locked asks whether some open file description holds a lock on fd's
// file, without taking one.
func locked(fd int) (bool, error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 0, Len: 0}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &lk); err != nil {
		return false, err
	}
	return lk.Type != unix.F_UNLCK, nil
}

// Decide says whether a pod, as the agent's watches see it now, is known
// not to be enrolled, and its UID. exists is false for a pod the watches do
// not have.
type Decide func(namespace, name string) (uid string, notEnrolled, exists bool)

// List is the agent's side.
type List struct {
	dir    string
	gen    string // this agent's generation, a directory in dir
	decide Decide
	log    *slog.Logger

	mu     sync.Mutex
	lock   *os.File // holds the generation's lock; nil once stopped
	closed bool
}

// Open starts this agent's generation of the list in dir: a new directory
// whose lock is held from its creation, not yet what the plugin reads (Run
// makes it current). Generations of agents that are no longer alive are
// removed; a live one's (another agent during a rolling update) is left to
// that agent.
func Open(dir string, decide Decide, log *slog.Logger) (*List, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("passlist: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("passlist: %w", err)
	}
	var l *List
	err := guarded(dir, func() error {
		var err error
		l, err = newGeneration(dir, decide, log)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("passlist: %w", err)
	}
	return l, nil
}

// guarded runs fn holding dir's open lock, which serialises what agents do
// to dir itself (create a generation, clear out the dead, swap "current"),
// so one agent never removes what another is creating. The kernel drops
// the lock if the agent dies meanwhile.
func guarded(dir string, fn func() error) error {
	guard, err := os.OpenFile(filepath.Join(dir, openLock), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer guard.Close()
	if err := setLock(guard, unix.F_OFD_SETLKW); err != nil {
		return fmt.Errorf("lock %s: %w", guard.Name(), err)
	}
	return fn()
}

func newGeneration(dir string, decide Decide, log *slog.Logger) (*List, error) {
	// Not crypto/rand: this package is linked into the plugin, which every
	// pod start execs, and the name only needs to be unique in dir.
	genDir, err := os.MkdirTemp(dir, genPrefix)
	if err != nil {
		return nil, err
	}
	gen := filepath.Base(genDir)
	// Go opens files close-on-exec, so the commands the agent runs
	// (iptables-restore) never inherit the lock and outlive it with it.
	lock, err := os.OpenFile(filepath.Join(dir, gen, lockFile), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		os.RemoveAll(filepath.Join(dir, gen))
		return nil, err
	}
	if err := setLock(lock, unix.F_OFD_SETLK); err != nil {
		lock.Close()
		os.RemoveAll(filepath.Join(dir, gen))
		return nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	l := &List{dir: dir, gen: gen, decide: decide, log: log, lock: lock}
	l.removeDead()
	return l, nil
}

func setLock(f *os.File, cmd int) error {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 0, Len: 0}
	for {
		err := unix.FcntlFlock(f.Fd(), cmd, &lk)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// removeDead removes the generations whose agent is gone (their lock is
// not held), and what an older layout left (a bare list with .alive).
func (l *List) removeDead() {
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		l.log.Warn("cannot clear dead agents' pass lists", "dir", l.dir, "err", err)
		return
	}
	for _, e := range ents {
		name := e.Name()
		if name == l.gen || name == openLock || name == currentLink {
			continue
		}
		if e.IsDir() && strings.HasPrefix(name, genPrefix) && lockHeld(filepath.Join(l.dir, name, lockFile)) {
			continue
		}
		if err := os.RemoveAll(filepath.Join(l.dir, name)); err != nil {
			l.log.Warn("cannot remove a dead agent's pass list", "path", filepath.Join(l.dir, name), "err", err)
		}
	}
}

func lockHeld(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	held, err := locked(fd)
	return err == nil && held
}

// Refresh brings one pod's entry in line with the agent's view. Call it
// after every change the watches deliver for the pod or its namespace;
// decisions are taken under the lock, so concurrent refreshes of a pod end
// with the latest view. After Run has returned it does nothing.
func (l *List) Refresh(namespace, name string) error {
	entry, ok := entryName(namespace, name)
	if !ok {
		return nil
	}
	path := filepath.Join(l.dir, l.gen, entry)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	uid, notEnrolled, exists := l.decide(namespace, name)
	if !exists || !notEnrolled || uid == "" {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("passlist: %w", err)
		}
		return nil
	}
	if have, err := os.ReadFile(path); err == nil && bytes.Equal(have, []byte(uid)) {
		return nil
	}
	return atomicfile.Write(path, []byte(uid), 0o600)
}

// Run makes this agent's generation the one the plugin reads and renews its
// heartbeat until ctx ends; then it drops the lock, so the plugin stops
// trusting the list at once, and removes the generation. Call it once the
// watches have synced.
func (l *List) Run(ctx context.Context) error {
	defer l.stop()
	if err := l.beat(time.Now()); err != nil {
		return fmt.Errorf("passlist: %w", err)
	}
	if err := guarded(l.dir, l.makeCurrent); err != nil {
		return fmt.Errorf("passlist: %w", err)
	}
	tick := time.NewTicker(HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-tick.C:
			if err := l.beat(now); err != nil {
				// Only makes the plugin ask the agent about every pod.
				l.log.Warn("cannot renew the pass list's heartbeat; inpod-cni will ask about every pod", "err", err)
			}
		}
	}
}

func (l *List) beat(now time.Time) error {
	return os.Chtimes(filepath.Join(l.dir, l.gen, lockFile), now, now)
}

// makeCurrent points "current" at this generation with one rename, so the
// plugin reads either the old generation or this one, never neither.
func (l *List) makeCurrent() error {
	tmp := filepath.Join(l.dir, atomicfile.TempPrefix+l.gen)
	os.Remove(tmp)
	if err := os.Symlink(l.gen, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(l.dir, currentLink)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// stop drops the lock first (the plugin distrusts the list from here on),
// then removes the generation. "current" is left for the next agent to
// replace: removing it could race another agent that has just made its own
// generation current.
func (l *List) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	l.lock.Close()
	l.lock = nil
	if err := os.RemoveAll(filepath.Join(l.dir, l.gen)); err != nil {
		l.log.Warn("cannot remove the pass list", "err", err)
	}
}

// String names this agent's generation of the list, for logs.
func (l *List) String() string { return filepath.Join(l.dir, l.gen) }
