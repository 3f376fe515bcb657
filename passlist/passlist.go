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
//     not passed;
//   - the list is trusted only while the agent's heartbeat (the mtime of
//     .alive, touched every HeartbeatInterval) is younger than MaxAge, and
//     the agent removes .alive when it stops. A dead or wedged agent's list
//     is ignored and the plugin falls back to asking the API server.
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

	"github.com/inpod-dev/inpod/internal/atomicfile"
)

const (
	// HeartbeatInterval is how often the agent renews the list.
	HeartbeatInterval = 10 * time.Second
	// MaxAge is how old a heartbeat may be for the plugin to trust the
	// list: a few missed beats, then the plugin asks.
	MaxAge = 3 * HeartbeatInterval

	aliveFile = ".alive"
)

func entryName(namespace, name string) (string, bool) {
	if namespace == "" || name == "" || strings.ContainsAny(namespace, "./") || strings.Contains(name, "/") || name == "." || name == ".." {
		return "", false
	}
	return namespace + "." + name, true
}

// Passes reports whether the list in dir, as the live agent keeps it, says
// the pod is not enrolled. uid may be empty when the runtime did not pass
// one. Any doubt (no heartbeat, an old one, no entry, another UID, an
// unreadable file) answers false: ask the agent.
func Passes(dir, namespace, name, uid string) bool {
	entry, ok := entryName(namespace, name)
	if !ok {
		return false
	}
	fi, err := os.Stat(filepath.Join(dir, aliveFile))
	if err != nil {
		return false
	}
	// A heartbeat from the future (the clock was set back) proves nothing.
	if age := time.Since(fi.ModTime()); age > MaxAge || age < -MaxAge {
		return false
	}
	have, err := os.ReadFile(filepath.Join(dir, entry))
	if err != nil || len(have) == 0 {
		return false
	}
	return uid == "" || string(have) == uid
}

// Decide says whether a pod, as the agent's watches see it now, is known
// not to be enrolled, and its UID. exists is false for a pod the watches do
// not have.
type Decide func(namespace, name string) (uid string, notEnrolled, exists bool)

// List is the agent's side.
type List struct {
	dir    string
	decide Decide
	log    *slog.Logger

	mu sync.Mutex
}

// Open empties dir (a previous agent's list says nothing about this one's
// view) and makes it root-only. The list is not trusted by the plugin until
// Run has written the first heartbeat.
func Open(dir string, decide Decide, log *slog.Logger) (*List, error) {
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("passlist: clear %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("passlist: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("passlist: %w", err)
	}
	return &List{dir: dir, decide: decide, log: log}, nil
}

// Refresh brings one pod's entry in line with the agent's view. Call it
// after every change the watches deliver for the pod or its namespace;
// decisions are taken under the lock, so concurrent refreshes of a pod end
// with the latest view.
func (l *List) Refresh(namespace, name string) error {
	entry, ok := entryName(namespace, name)
	if !ok {
		return nil
	}
	path := filepath.Join(l.dir, entry)
	l.mu.Lock()
	defer l.mu.Unlock()
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

// Run renews the heartbeat until ctx ends, then withdraws it so the plugin
// stops trusting the list at once.
func (l *List) Run(ctx context.Context) error {
	alive := filepath.Join(l.dir, aliveFile)
	if err := atomicfile.Write(alive, nil, 0o600); err != nil {
		return err
	}
	defer os.Remove(alive)
	tick := time.NewTicker(HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			now := time.Now()
			if err := os.Chtimes(alive, now, now); err != nil {
				// Gone (removed by hand?): recreate it. Failing here
				// only makes the plugin ask the agent about every pod.
				if err := atomicfile.Write(alive, nil, 0o600); err != nil {
					l.log.Warn("cannot renew the pass list's heartbeat; inpod-cni will ask about every pod", "err", err)
				}
			}
		}
	}
}
