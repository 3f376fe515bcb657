// Package cniinstall puts inpod-cni on the node and keeps it there: it
// copies the plugin and its companion binary into the CNI bin dir
// atomically, puts the plugin last in the chain the runtime uses, and
// watches both so that a CNI that rewrites its file is repaired, with the
// node reported not ready until it is. Uninstall restores what it found.
//
// The chain lives in one of two places. Chained, inpod-cni is appended to
// the primary CNI's own file: a primary that rewrites its file while the
// agent is away (its installer runs on every start, so at every reboot)
// takes inpod out of the chain until the agent is back, and sandboxes
// started meanwhile run without it. Owned, inpod writes its own file,
// named to sort before the primary's so the runtime uses it, holding the
// primary's plugins and inpod-cni last, and leaves the primary's file
// alone: a rewrite of the primary's file no longer changes the chain the
// runtime uses, agent or no agent; while the agent runs the copy follows
// the primary's file. The owned file stays when the agent stops or
// restarts and goes only with Uninstall, so the plugin keeps failing
// enrolled pods closed while the agent is away. The price: while the agent
// is away the copy can go stale (a primary upgraded then keeps its old
// plugin settings in the chain until the agent is back), and a primary
// that removes every other file from the directory (Cilium's
// cni.exclusive) removes inpod's too.
package cniinstall

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/internal/atomicfile"
)

// PluginType is the plugin's type in the conflist.
const PluginType = cnievent.PluginBinary

// binaries are installed together: the plugin, and the companion it runs to
// decide enrollment while the agent is unreachable.
var binaries = []string{cnievent.PluginBinary, cnievent.APICheckBinary}

// Entry is inpod's plugin entry.
type Entry struct {
	AgentSocket       string   `json:"agentSocket,omitempty"`
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
	APIAccess         string   `json:"apiAccess,omitempty"`
	PassList          string   `json:"passList,omitempty"`
	Timeout           string   `json:"timeout,omitempty"`
}

func (e Entry) marshal() (json.RawMessage, error) {
	return json.Marshal(struct {
		Type string `json:"type"`
		Entry
	}{PluginType, e})
}

// Config says where things are. Every path is configurable so tests and
// unusual nodes work alike.
type Config struct {
	// SourceDir holds inpod-cni and inpod-cni-apicheck as shipped in the
	// agent's image.
	SourceDir string
	BinDir    string // default /opt/cni/bin
	ConfDir   string // default /etc/cni/net.d
	// StateDir keeps the originals of files inpod changed, and the name
	// of the file it owns, for Uninstall and for a change of mode.
	StateDir string // default /var/lib/inpod/cni
	// OwnedFile, when set, is the file in ConfDir inpod owns (owned mode,
	// see the package doc); empty chains into the primary's file. The
	// name must sort before the primary's: Check reports the node not
	// installed, naming the file that wins, when it does not.
	OwnedFile string
	Entry     Entry
	// Resync re-checks even without file events (default 30 s).
	Resync time.Duration
	// MaxRepairsPerMinute above which repairs pause and a loud warning is
	// logged: something keeps rewriting the config (default 5).
	MaxRepairsPerMinute int
	// OnChange is told every change of "installed" with the reason.
	OnChange func(installed bool, reason string)
	Logger   *slog.Logger
}

// Installer installs and guards the plugin.
type Installer struct {
	cfg   Config
	log   *slog.Logger
	entry json.RawMessage
	// want is each binary's digest, by name. Not the bytes: the two
	// binaries are ~9 MiB, which the agent held for its whole life and
	// read again on every check, most of its heap.
	want map[string]digest

	mu        sync.Mutex
	installed bool
	reason    string
	reported  bool
	repairs   []time.Time
	// everInstalled tells a repair from the first install in the logs.
	everInstalled bool
}

// New reads the binary to install and validates cfg.
func New(cfg Config) (*Installer, error) {
	if cfg.BinDir == "" {
		cfg.BinDir = "/opt/cni/bin"
	}
	if cfg.ConfDir == "" {
		cfg.ConfDir = "/etc/cni/net.d"
	}
	if cfg.StateDir == "" {
		cfg.StateDir = "/var/lib/inpod/cni"
	}
	if cfg.Resync <= 0 {
		cfg.Resync = 30 * time.Second
	}
	if cfg.MaxRepairsPerMinute <= 0 {
		cfg.MaxRepairsPerMinute = 5
	}
	if n := cfg.OwnedFile; n != "" && (n != filepath.Base(n) || filepath.Ext(n) != ".conflist") {
		return nil, fmt.Errorf("cniinstall: the owned CNI configuration %q must be a file name ending in .conflist", n)
	}
	want := map[string]digest{}
	for _, name := range binaries {
		d, err := digestOf(filepath.Join(cfg.SourceDir, name))
		if err != nil {
			return nil, fmt.Errorf("cniinstall: read the binary to install: %w", err)
		}
		want[name] = d
	}
	entry, err := cfg.Entry.marshal()
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Installer{cfg: cfg, log: log.With("component", "cniinstall"), entry: entry, want: want}, nil
}

// Status says whether the plugin is installed and why not.
type Status struct {
	Installed bool
	// Conflist is the primary configuration file.
	Conflist string
	Reason   string
}

// Check reports, reading only, whether the binaries are in place and the
// configuration the runtime uses ends with inpod's entry (owned mode: is
// inpod's file, an exact copy of the primary's with the entry last).
func (i *Installer) Check() Status {
	for _, name := range binaries {
		bin := filepath.Join(i.cfg.BinDir, name)
		same, err := i.matches(bin, name)
		if err != nil {
			return Status{Reason: fmt.Sprintf("plugin binary %s: %v", bin, err)}
		}
		if !same {
			return Status{Reason: fmt.Sprintf("plugin binary %s differs from this agent's", bin)}
		}
	}
	if i.cfg.OwnedFile != "" {
		return i.checkOwned()
	}
	if left := i.recordedOwned(); left != "" {
		if _, err := os.Stat(filepath.Join(i.cfg.ConfDir, left)); err == nil {
			return Status{Reason: fmt.Sprintf("%s, left from the owned mode, comes first in %s", left, i.cfg.ConfDir)}
		}
	}
	path, list, err := primaryConfig(i.cfg.ConfDir)
	if err != nil {
		return Status{Reason: err.Error()}
	}
	if list.fromConf || !list.hasEntryLast(i.entry) {
		return Status{Conflist: path, Reason: fmt.Sprintf("%s does not end with the inpod-cni entry", path)}
	}
	return Status{Installed: true, Conflist: path}
}

func (i *Installer) checkOwned() Status {
	owned := filepath.Join(i.cfg.ConfDir, i.cfg.OwnedFile)
	primaryPath, primary, err := primaryConfig(i.cfg.ConfDir, i.cfg.OwnedFile, i.recordedOwned())
	if err != nil {
		return Status{Conflist: owned, Reason: err.Error()}
	}
	want, err := primary.withEntry(i.entry).marshal()
	if err != nil {
		return Status{Conflist: owned, Reason: err.Error()}
	}
	data, err := os.ReadFile(owned)
	if err != nil {
		return Status{Conflist: owned, Reason: fmt.Sprintf("inpod's CNI configuration: %v", err)}
	}
	if !jsonEqual(data, want) {
		return Status{Conflist: owned, Reason: fmt.Sprintf("%s is not %s with inpod-cni last: the primary changed, or the copy did", owned, primaryPath)}
	}
	if used, _, err := primaryConfig(i.cfg.ConfDir); err != nil || used != owned {
		return Status{Conflist: owned, Reason: fmt.Sprintf("the runtime uses %s, not %s: name inpod's file to sort before it", used, owned)}
	}
	return Status{Installed: true, Conflist: owned}
}

// Install copies the binaries and puts inpod-cni last in the chain the
// runtime uses; when both are already right it writes nothing.
func (i *Installer) Install() (Status, error) {
	for _, name := range binaries {
		if err := i.installBinary(name); err != nil {
			return Status{Reason: err.Error()}, err
		}
	}
	if i.cfg.OwnedFile != "" {
		return i.installOwned()
	}
	// A file left from the owned mode sorts first: chain the primary's
	// before it goes, so the runtime never sees a chain without inpod.
	left := i.recordedOwned()
	path, list, err := primaryConfig(i.cfg.ConfDir, left)
	if err != nil {
		return Status{Reason: err.Error()}, err
	}
	if list.fromConf || !list.hasEntryLast(i.entry) {
		if path, err = i.chain(path, list); err != nil {
			return Status{Reason: err.Error()}, err
		}
	}
	if left != "" {
		if err := i.forgetOwned(left); err != nil {
			return Status{Reason: err.Error()}, err
		}
	}
	return Status{Installed: true, Conflist: path}, nil
}

// chain appends inpod's entry to the primary's file and returns the file
// written.
func (i *Installer) chain(path string, list *conflist) (string, error) {
	if err := i.backup(path); err != nil {
		return "", err
	}
	data, err := list.withEntry(i.entry).marshal()
	if err != nil {
		return "", err
	}
	target := path
	if list.fromConf {
		// A runtime reads a .conf as a single plugin: the chain needs a
		// .conflist, under the same name so it keeps its place in order.
		target = strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
	}
	if err := writeFile(target, data, fileMode(path)); err != nil {
		return "", err
	}
	if target != path {
		if err := os.Remove(path); err != nil {
			return "", fmt.Errorf("cniinstall: remove converted %s: %w", path, err)
		}
	}
	i.log.Info("chained inpod-cni into the primary CNI configuration", "file", target)
	return target, nil
}

// installOwned writes inpod's file from the primary's. With no valid
// primary file (being rewritten, or the primary uninstalled) inpod's file
// stays as it is: removing it would let the runtime use the primary's
// file, without inpod, the moment it comes back; the node is reported not
// installed meanwhile.
func (i *Installer) installOwned() (Status, error) {
	owned := filepath.Join(i.cfg.ConfDir, i.cfg.OwnedFile)
	// Not the file a rename leaves either: it is inpod's old copy.
	previous := i.recordedOwned()
	primaryPath, primary, err := primaryConfig(i.cfg.ConfDir, i.cfg.OwnedFile, previous)
	if err != nil {
		return Status{Conflist: owned, Reason: err.Error()}, err
	}
	data, err := primary.withEntry(i.entry).marshal()
	if err != nil {
		return Status{Conflist: owned, Reason: err.Error()}, err
	}
	if !i.mayWriteOwned(owned) {
		err := fmt.Errorf("cniinstall: %s exists and is not inpod's (never written by inpod, and its chain does not end with inpod-cni); not overwriting it: choose another --cni-owned-config-file", owned)
		return Status{Conflist: owned, Reason: err.Error()}, err
	}
	if cur, err := os.ReadFile(owned); err != nil || !jsonEqual(cur, data) {
		if err := writeFile(owned, data, 0o644); err != nil {
			return Status{Conflist: owned, Reason: err.Error()}, err
		}
		i.log.Info("wrote inpod's CNI configuration from the primary's", "file", owned, "primary", primaryPath)
	}
	// A renamed file's old copy goes before the record names the new
	// one: a crash in between leaves the old name recorded, removed on
	// the next start, never an old copy no record names.
	renamed := ""
	if previous != "" && previous != i.cfg.OwnedFile {
		renamed = previous
	}
	if renamed != "" {
		if err := os.Remove(filepath.Join(i.cfg.ConfDir, renamed)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return Status{Conflist: owned, Reason: err.Error()}, fmt.Errorf("cniinstall: %w", err)
		}
	}
	if err := i.recordOwned(); err != nil {
		return Status{Conflist: owned, Reason: err.Error()}, err
	}
	// Only once the runtime uses inpod's file: a name that sorts after
	// the primary's must not cost the primary's file its entry.
	if used, _, err := primaryConfig(i.cfg.ConfDir); err != nil || used != owned {
		return i.checkOwned(), fmt.Errorf("cniinstall: the runtime uses %s, not %s: name inpod's file to sort before it", used, owned)
	}
	// An entry left in the primary's file by the chained mode goes once
	// inpod's file is in place, so nothing but inpod's file chains it.
	if len(primary.without().plugins) != len(primary.plugins) {
		if err := i.unchain(filepath.Base(primaryPath)); err != nil {
			return Status{Conflist: owned, Reason: err.Error()}, err
		}
	}
	if st := i.checkOwned(); !st.Installed {
		return st, errors.New(st.Reason)
	}
	return Status{Installed: true, Conflist: owned}, nil
}

// mayWriteOwned says whether the file at path may be (over)written as
// inpod's own: it does not exist, inpod recorded it, or its chain ends with
// inpod-cni (inpod's, its record lost). A name given by mistake that is the
// primary's own file (or any other CNI's) is refused rather than replaced.
func (i *Installer) mayWriteOwned(path string) bool {
	if i.recordedOwned() == i.cfg.OwnedFile {
		return true
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return true
	}
	return i.endsWithInpod(path)
}

// endsWithInpod says whether the file at path is a configuration whose
// chain ends with inpod-cni.
func (i *Installer) endsWithInpod(path string) bool {
	data, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	list, err := parseConfFile(data)
	return err == nil && len(list.plugins) > 0 && pluginType(list.plugins[len(list.plugins)-1]) == PluginType
}

// ownedRecord names the file holding the owned file's name.
func (i *Installer) ownedRecord() string { return filepath.Join(i.cfg.StateDir, "owned-file") }

func (i *Installer) recordedOwned() string {
	data, err := os.ReadFile(i.ownedRecord())
	if err != nil {
		return ""
	}
	// Only a plain name in ConfDir: the record is inpod's, but a name
	// with a path in it would make Uninstall remove a file elsewhere.
	name := strings.TrimSpace(string(data))
	if name != filepath.Base(name) || name == "." || name == ".." {
		return ""
	}
	return name
}

// recordOwned records the owned file's name.
func (i *Installer) recordOwned() error {
	if i.recordedOwned() == i.cfg.OwnedFile {
		return nil
	}
	if err := os.MkdirAll(i.cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("cniinstall: %w", err)
	}
	return writeFile(i.ownedRecord(), []byte(i.cfg.OwnedFile+"\n"), 0o600)
}

// forgetOwned removes a file the owned mode wrote, and its record.
func (i *Installer) forgetOwned(name string) error {
	path := filepath.Join(i.cfg.ConfDir, name)
	err := os.Remove(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cniinstall: %w", err)
	}
	if err == nil {
		i.log.Info("removed inpod's CNI configuration", "file", path)
	}
	if err := os.Remove(i.ownedRecord()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cniinstall: %w", err)
	}
	return nil
}

func (i *Installer) installBinary(name string) error {
	dst := filepath.Join(i.cfg.BinDir, name)
	if same, err := i.matches(dst, name); err == nil && same {
		return nil
	}
	// Read only to copy, and dropped again: installs are rare (the first,
	// and repairs).
	data, err := os.ReadFile(filepath.Join(i.cfg.SourceDir, name))
	if err != nil {
		return fmt.Errorf("cniinstall: read the binary to install: %w", err)
	}
	if (digest{int64(len(data)), sha256.Sum256(data)}) != i.want[name] {
		return fmt.Errorf("cniinstall: %s changed in %s since the agent started; not installing it", name, i.cfg.SourceDir)
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return fmt.Errorf("cniinstall: %w", err)
	}
	if err := writeFile(dst, data, 0o755); err != nil {
		return err
	}
	i.log.Info("installed a plugin binary", "path", dst)
	return nil
}

// backup keeps the first version of a file inpod changes, for Uninstall.
func (i *Installer) backup(path string) error {
	dir := filepath.Join(i.cfg.StateDir, "originals")
	dst := filepath.Join(dir, filepath.Base(path))
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("cniinstall: %w", err)
	}
	return writeFile(dst, data, 0o600)
}

// Uninstall removes inpod's own file, takes inpod out of every other
// configuration in the conf dir, restoring a file's original bytes when
// nothing else changed it since, and removes the binaries. Used when inpod
// is removed from the node, never on an agent restart: while the agent is
// away the plugin stays, so enrolled pods fail closed.
func (i *Installer) Uninstall() error {
	for _, name := range []string{i.cfg.OwnedFile, i.recordedOwned()} {
		// Only inpod's: a configured name that is another CNI's file
		// (refused at install) must not be deleted at removal.
		if name != "" && (name == i.recordedOwned() || i.endsWithInpod(filepath.Join(i.cfg.ConfDir, name))) {
			if err := i.forgetOwned(name); err != nil {
				return err
			}
		}
	}
	entries, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, e := range entries {
		if err := i.unchain(e.Name()); err != nil {
			return err
		}
	}
	for _, name := range binaries {
		if err := os.Remove(filepath.Join(i.cfg.BinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return os.RemoveAll(filepath.Join(i.cfg.StateDir, "originals"))
}

// unchain takes inpod's entries out of one file of the conf dir, restoring
// its original when what is left is what inpod found.
func (i *Installer) unchain(name string) error {
	path := filepath.Join(i.cfg.ConfDir, name)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	list, err := parseConfFile(data)
	if err != nil || len(list.without().plugins) == len(list.plugins) {
		return nil
	}
	stripped := list.without()
	originals := filepath.Join(i.cfg.StateDir, "originals")
	restored := false
	base := strings.TrimSuffix(name, ".conflist")
	for _, orig := range []string{name, base + ".conf", base + ".json"} {
		data, err := os.ReadFile(filepath.Join(originals, orig))
		if err != nil {
			continue
		}
		origList, err := parseConfFile(data)
		if err != nil || !sameList(origList, stripped) {
			continue
		}
		if err := writeFile(filepath.Join(i.cfg.ConfDir, orig), data, fileMode(path)); err != nil {
			return err
		}
		if orig != name {
			os.Remove(path)
		}
		restored = true
		break
	}
	if !restored {
		out, err := stripped.marshal()
		if err != nil {
			return err
		}
		if err := writeFile(path, out, fileMode(path)); err != nil {
			return err
		}
	}
	i.log.Info("removed inpod-cni from CNI configuration", "file", path, "restoredOriginal", restored)
	return nil
}

func sameList(a, b *conflist) bool {
	x, err1 := a.marshal()
	y, err2 := b.marshal()
	return err1 == nil && err2 == nil && jsonEqual(x, y)
}

// Run installs, then keeps the installation intact until ctx ends: file
// events (and a periodic resync) trigger a check, and a broken installation
// is repaired, at most MaxRepairsPerMinute times a minute. It waits for a
// primary configuration to appear when there is none yet.
func (i *Installer) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("cniinstall: %w", err)
	}
	defer w.Close()
	for _, dir := range []string{i.cfg.ConfDir, i.cfg.BinDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("cniinstall: %w", err)
		}
		if err := w.Add(dir); err != nil {
			return fmt.Errorf("cniinstall: watch %s: %w", dir, err)
		}
	}
	i.reconcile()
	resync := time.NewTicker(i.cfg.Resync)
	defer resync.Stop()
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev := <-w.Events:
			if atomicfile.IsTemp(ev.Name) {
				continue
			}
		case err := <-w.Errors:
			i.log.Warn("file watch error; relying on resync", "err", err)
		case <-resync.C:
		case <-retry:
			retry = nil
		}
		// Coalesce a burst of events (an installer writing several files).
		drain(w.Events, 20*time.Millisecond)
		if wait := i.reconcile(); wait > 0 && retry == nil {
			retry = time.After(wait)
		}
	}
}

func drain(events <-chan fsnotify.Event, quiet time.Duration) {
	for {
		select {
		case <-events:
		case <-time.After(quiet):
			return
		}
	}
}

// reconcile checks and, when needed and allowed, repairs. It returns how long
// to wait before trying again when repairs are being rate-limited.
func (i *Installer) reconcile() time.Duration {
	st := i.Check()
	if st.Installed {
		i.report(true, "")
		return 0
	}
	i.report(false, st.Reason)
	if wait := i.repairBudget(); wait > 0 {
		i.log.Error("inpod-cni keeps being removed from the CNI configuration; another component is rewriting it. Pausing repairs; pods needing redirection cannot be scheduled here meanwhile",
			"repairsInLastMinute", i.cfg.MaxRepairsPerMinute, "retryIn", wait, "reason", st.Reason)
		return wait
	}
	st, err := i.Install()
	if err != nil {
		if errors.Is(err, errNoConfig) {
			i.log.Info("waiting for the primary CNI configuration", "dir", i.cfg.ConfDir)
		} else {
			i.log.Error("could not install inpod-cni", "err", err)
		}
		return 0
	}
	if i.everInstalled {
		i.log.Warn("repaired the CNI installation", "file", st.Conflist, "was", i.reasonText())
	}
	i.report(st.Installed, st.Reason)
	return 0
}

func (i *Installer) reasonText() string {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.reason
}

func (i *Installer) repairBudget() time.Duration {
	i.mu.Lock()
	defer i.mu.Unlock()
	now := time.Now()
	kept := i.repairs[:0]
	for _, t := range i.repairs {
		if now.Sub(t) < time.Minute {
			kept = append(kept, t)
		}
	}
	i.repairs = kept
	if len(i.repairs) >= i.cfg.MaxRepairsPerMinute {
		return time.Minute - now.Sub(i.repairs[0])
	}
	i.repairs = append(i.repairs, now)
	return 0
}

func (i *Installer) report(installed bool, reason string) {
	i.mu.Lock()
	if installed {
		i.everInstalled = true
	}
	changed := !i.reported || installed != i.installed
	i.installed, i.reason, i.reported = installed, reason, true
	i.mu.Unlock()
	if !changed {
		return
	}
	if installed {
		i.log.Info("inpod-cni is installed")
	} else {
		i.log.Warn("inpod-cni is not installed", "reason", reason)
	}
	if i.cfg.OnChange != nil {
		i.cfg.OnChange(installed, reason)
	}
}

func fileMode(path string) os.FileMode {
	if fi, err := os.Stat(path); err == nil {
		return fi.Mode().Perm()
	}
	return 0o644
}

// digest identifies a binary's content.
type digest struct {
	size int64
	sum  [sha256.Size]byte
}

// matches says whether the file at path is the binary name of this
// agent's image; one of another size differs without being read.
func (i *Installer) matches(path, name string) (bool, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return false, err
	}
	if fi.Size() != i.want[name].size {
		return false, nil
	}
	d, err := digestOf(path)
	return d == i.want[name], err
}

// digestOf streams the file through SHA-256, so a check holds no copy of
// it.
func digestOf(path string) (digest, error) {
	f, err := os.Open(path)
	if err != nil {
		return digest{}, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return digest{}, err
	}
	d := digest{size: n}
	h.Sum(d.sum[:0])
	return d, nil
}

// writeFile replaces a file atomically, naming the package in errors.
func writeFile(path string, data []byte, mode os.FileMode) error {
	if err := atomicfile.Write(path, data, mode); err != nil {
		return fmt.Errorf("cniinstall: %w", err)
	}
	return nil
}
