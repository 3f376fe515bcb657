// Package cniinstall puts inpod-cni on the node and keeps it there: it
// copies the plugin and its companion binary into the CNI bin dir
// atomically, chains the plugin last into the node's primary network
// configuration, and watches both so that a CNI that rewrites its file
// (dropping inpod) is repaired, with the node reported not ready until it
// is. Uninstall restores what it found.
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
	// StateDir keeps the originals of files inpod changed, for Uninstall.
	StateDir string // default /var/lib/inpod/cni
	Entry    Entry
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

// Check reports, reading only, whether the binary is in place and inpod is
// the last plugin of the primary configuration.
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
	path, list, err := primaryConfig(i.cfg.ConfDir)
	if err != nil {
		return Status{Reason: err.Error()}
	}
	if list.fromConf || !list.hasEntryLast(i.entry) {
		return Status{Conflist: path, Reason: fmt.Sprintf("%s does not end with the inpod-cni entry", path)}
	}
	return Status{Installed: true, Conflist: path}
}

// Install copies the binaries and chains the plugin into the primary
// configuration; when both are already right it writes nothing.
func (i *Installer) Install() (Status, error) {
	for _, name := range binaries {
		if err := i.installBinary(name); err != nil {
			return Status{Reason: err.Error()}, err
		}
	}
	path, list, err := primaryConfig(i.cfg.ConfDir)
	if err != nil {
		return Status{Reason: err.Error()}, err
	}
	if !list.fromConf && list.hasEntryLast(i.entry) {
		return Status{Installed: true, Conflist: path}, nil
	}
	if err := i.backup(path); err != nil {
		return Status{Reason: err.Error()}, err
	}
	data, err := list.withEntry(i.entry).marshal()
	if err != nil {
		return Status{Reason: err.Error()}, err
	}
	target := path
	if list.fromConf {
		// A runtime reads a .conf as a single plugin: the chain needs a
		// .conflist, under the same name so it keeps its place in order.
		target = strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
	}
	if err := writeFile(target, data, fileMode(path)); err != nil {
		return Status{Reason: err.Error()}, err
	}
	if target != path {
		if err := os.Remove(path); err != nil {
			return Status{Reason: err.Error()}, fmt.Errorf("cniinstall: remove converted %s: %w", path, err)
		}
	}
	i.log.Info("chained inpod-cni into the primary CNI configuration", "file", target)
	return Status{Installed: true, Conflist: target}, nil
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

// Uninstall takes inpod out of every configuration in the conf dir,
// restoring a file's original bytes when nothing else changed it since,
// and removes the binaries. Used when inpod is removed from the node, never
// on an agent restart: while the agent is away the plugin stays, so
// enrolled pods fail closed.
func (i *Installer) Uninstall() error {
	entries, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	originals := filepath.Join(i.cfg.StateDir, "originals")
	for _, e := range entries {
		path := filepath.Join(i.cfg.ConfDir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		list, err := parseConfFile(data)
		if err != nil || len(list.without().plugins) == len(list.plugins) {
			continue
		}
		stripped := list.without()
		restored := false
		for _, name := range []string{e.Name(), strings.TrimSuffix(e.Name(), ".conflist") + ".conf", strings.TrimSuffix(e.Name(), ".conflist") + ".json"} {
			orig, err := os.ReadFile(filepath.Join(originals, name))
			if err != nil {
				continue
			}
			origList, err := parseConfFile(orig)
			if err != nil || !sameList(origList, stripped) {
				continue
			}
			if err := writeFile(filepath.Join(i.cfg.ConfDir, name), orig, fileMode(path)); err != nil {
				return err
			}
			if name != e.Name() {
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
	}
	for _, name := range binaries {
		if err := os.Remove(filepath.Join(i.cfg.BinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return os.RemoveAll(originals)
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
