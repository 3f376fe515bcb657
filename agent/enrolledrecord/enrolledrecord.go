// Package enrolledrecord keeps, on the node, which pods the agent has put
// redirection rules into, so that an agent that starts after another died
// knows them even when nothing in the API says so yet.
//
// The pod's redirection annotation says the same thing, but it is written
// off the ADD's path, through the API, and may land after the ADD is
// answered (in a burst, most do). A pod whose agent died in between looks
// never enrolled to the next agent: with no IPs in its status yet it is
// not held, so ztunnel's next snapshot drops the proxy its rules point at;
// taken out of the mesh while no agent ran, it keeps its rules and its
// traffic goes nowhere, a pod outside the mesh blocked. A record written
// before the rules closes that window:
//
//   - one file per pod, named by its API UID, in a root-only directory;
//     written before the pod's rules are applied, so any pod with rules
//     has a record, and removed only once its rules are out (or its
//     sandbox start failed and they were rolled back);
//   - the file holds the IPs of the sandbox enrolled, one per line, as
//     the primary CNI gave them: the next agent finds the pod's netns by
//     them (with its cgroup, podnetns) before the kubelet has written
//     them into the pod's status, which on a busy node comes seconds
//     after the sandbox is up. A record whose write was cut short holds
//     the lines written whole (an empty one, none): the IPs only narrow a
//     search that the pod's cgroup decides;
//   - a record without rules (the agent died between the two) only makes
//     the next agent treat the pod as enrolled: it re-applies the rules if
//     the pod is in the mesh, or removes none and tells ztunnel Del if not,
//     both harmless;
//   - the directory belongs on a tmpfs (next to the agent's sockets under
//     /var/run): a reboot ends every sandbox, and their records with it.
//
// Writes are a create and a close, no fsync: the file outlives the process
// in the page cache, and a node crash ends the sandboxes too.
package enrolledrecord

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Dir is the record: one file per enrolled pod.
type Dir struct {
	path string
}

// Open makes the directory (root only) if needed.
func Open(path string) (*Dir, error) {
	if err := os.MkdirAll(path, 0o700); err != nil {
		return nil, fmt.Errorf("enrolled-pod record: %w", err)
	}
	if err := os.Chmod(path, 0o700); err != nil {
		return nil, fmt.Errorf("enrolled-pod record: %w", err)
	}
	return &Dir{path: path}, nil
}

// Path is the directory.
func (d *Dir) Path() string { return d.path }

// maxUIDLen is Kubernetes' bound on a UID (and the ZDS Add's).
const maxUIDLen = 128

// fileFor names uid's file. API server UIDs are UUIDs; anything that could
// leave the directory or hide as a dot file is refused.
func (d *Dir) fileFor(uid string) (string, error) {
	if uid == "" || len(uid) > maxUIDLen || uid[0] == '.' {
		return "", fmt.Errorf("enrolled-pod record: pod UID %q cannot name a file", uid)
	}
	for _, c := range uid {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return "", fmt.Errorf("enrolled-pod record: pod UID %q cannot name a file", uid)
		}
	}
	return filepath.Join(d.path, uid), nil
}

// Record notes uid as enrolled in a sandbox holding ips; recording it
// again replaces the IPs.
func (d *Dir) Record(uid string, ips []netip.Addr) error {
	name, err := d.fileFor(uid)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("enrolled-pod record: %w", err)
	}
	var b strings.Builder
	for _, ip := range ips {
		b.WriteString(ip.String())
		b.WriteByte('\n')
	}
	_, err = f.WriteString(b.String())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// The record exists (the pod counts as enrolled), its IPs may
		// not: read back as none.
		return fmt.Errorf("enrolled-pod record: %w", err)
	}
	return nil
}

// maxRecordSize bounds what IPs reads: a pod has at most a few IPs.
const maxRecordSize = 4096

// IPs returns the sandbox IPs uid's record holds; none when it has no
// record, one holding no IPs (written by a release before records held
// them), or one with a line that is no IP or no newline at its end.
func (d *Dir) IPs(uid string) ([]netip.Addr, error) {
	name, err := d.fileFor(uid)
	if err != nil {
		return nil, nil
	}
	f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("enrolled-pod record: %w", err)
	}
	defer f.Close()
	buf, err := io.ReadAll(io.LimitReader(f, maxRecordSize+1))
	if err != nil {
		return nil, fmt.Errorf("enrolled-pod record: %w", err)
	}
	if len(buf) == 0 || len(buf) > maxRecordSize || buf[len(buf)-1] != '\n' {
		return nil, nil // none, not the agent's, or cut short
	}
	var ips []netip.Addr
	for line := range strings.Lines(string(buf)) {
		ip, err := netip.ParseAddr(strings.TrimSuffix(line, "\n"))
		if err != nil {
			return nil, nil
		}
		ips = append(ips, ip)
	}
	return ips, nil
}

// Forget removes uid's record; one that is not there is no error.
func (d *Dir) Forget(uid string) error {
	name, err := d.fileFor(uid)
	if err != nil {
		return err
	}
	if err := os.Remove(name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("enrolled-pod record: %w", err)
	}
	return nil
}

// Recorded says whether uid has a record. An error means it cannot be
// told (the caller must not take that for "no"); a UID that cannot name a
// record has none.
func (d *Dir) Recorded(uid string) (bool, error) {
	name, err := d.fileFor(uid)
	if err != nil {
		return false, nil
	}
	fi, err := os.Lstat(name)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("enrolled-pod record: %w", err)
	}
	return fi.Mode().IsRegular(), nil
}

// List returns every recorded UID.
func (d *Dir) List() ([]string, error) {
	entries, err := os.ReadDir(d.path)
	if err != nil {
		return nil, fmt.Errorf("enrolled-pod record: %w", err)
	}
	uids := make([]string, 0, len(entries))
	for _, e := range entries {
		if _, err := d.fileFor(e.Name()); err == nil && e.Type().IsRegular() {
			uids = append(uids, e.Name())
		}
	}
	return uids, nil
}

// Remove deletes the record and its directory (inpod leaves the node).
func (d *Dir) Remove() error {
	if err := os.RemoveAll(d.path); err != nil {
		return fmt.Errorf("enrolled-pod record: %w", err)
	}
	return nil
}
