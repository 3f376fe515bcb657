package cniinstall_test

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/agent/cniinstall"
)

var update = flag.Bool("update", false, "rewrite the golden files")

var entry = cniinstall.Entry{
	AgentSocket:       "/var/run/inpod/cni.sock",
	ExcludeNamespaces: []string{"kube-system"},
	APIAccess:         "/etc/cni/net.d/inpod-api-access",
	PassList:          "/var/run/inpod/not-enrolled",
}

type env struct {
	confDir, binDir, stateDir, source string
}

// newEnv copies a test case's input files (mode 0640, to see modes kept)
// into a fresh conf dir and makes a fake plugin binary.
func newEnv(t *testing.T, caseName string) *env {
	t.Helper()
	root := t.TempDir()
	e := &env{confDir: filepath.Join(root, "net.d"), binDir: filepath.Join(root, "bin"),
		stateDir: filepath.Join(root, "state"), source: filepath.Join(root, "image")}
	os.MkdirAll(e.confDir, 0o755)
	if caseName != "" {
		files, _ := os.ReadDir(filepath.Join("testdata", caseName, "in"))
		for _, f := range files {
			data, err := os.ReadFile(filepath.Join("testdata", caseName, "in", f.Name()))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(e.confDir, f.Name()), data, 0o640); err != nil {
				t.Fatal(err)
			}
		}
	}
	os.MkdirAll(e.source, 0o755)
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		if err := os.WriteFile(filepath.Join(e.source, name), []byte("#!/bin/sh\necho fake "+name+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e *env) installer(t *testing.T, mod func(*cniinstall.Config)) *cniinstall.Installer {
	t.Helper()
	cfg := cniinstall.Config{SourceDir: e.source, BinDir: e.binDir, ConfDir: e.confDir, StateDir: e.stateDir, Entry: entry}
	if mod != nil {
		mod(&cfg)
	}
	i, err := cniinstall.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// snapshot is every file of a dir: name → content, plus modes and inodes.
type fileInfo struct {
	data  string
	mode  os.FileMode
	inode uint64
}

func snapshot(t *testing.T, dir string) map[string]fileInfo {
	t.Helper()
	out := map[string]fileInfo{}
	files, _ := os.ReadDir(dir)
	for _, f := range files {
		p := filepath.Join(dir, f.Name())
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		fi, _ := os.Stat(p)
		out[f.Name()] = fileInfo{string(data), fi.Mode().Perm(), fi.Sys().(*syscall.Stat_t).Ino}
	}
	return out
}

func TestInstallGoldenAndUninstallRestores(t *testing.T) {
	for _, tc := range []struct{ name, primary string }{
		{"calico", "10-calico.conflist"},
		{"cilium", "05-cilium.conflist"},
		{"bare-conf", "10-bridge.conflist"},
		{"several", "10-primary.conflist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.name)
			original := snapshot(t, e.confDir)
			inst := e.installer(t, nil)
			st, err := inst.Install()
			if err != nil || !st.Installed || filepath.Base(st.Conflist) != tc.primary {
				t.Fatalf("Install = %+v, %v; want installed into %s", st, err, tc.primary)
			}
			installed := snapshot(t, e.confDir)
			golden := filepath.Join("testdata", tc.name, "installed.golden")
			got := installed[tc.primary].data
			if *update {
				os.WriteFile(golden, []byte(got), 0o644)
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if got != string(want) {
				t.Errorf("%s after install:\n%s\nwant (%s):\n%s", tc.primary, got, golden, want)
			}
			for name, f := range installed {
				if name == tc.primary {
					if f.mode != 0o640 {
						t.Errorf("%s mode %v, want the original 0640 kept", name, f.mode)
					}
					continue
				}
				if orig, ok := original[name]; !ok || orig.data != f.data {
					t.Errorf("Install touched %s, which is not the primary configuration", name)
				}
			}
			for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
				if bin, err := os.ReadFile(filepath.Join(e.binDir, name)); err != nil || !strings.Contains(string(bin), "fake "+name+"\n") {
					t.Errorf("%s not installed: %v", name, err)
				}
			}
			if st := inst.Check(); !st.Installed {
				t.Fatalf("Check after Install: %+v", st)
			}

			// Re-running changes nothing, not even the file's inode.
			if _, err := inst.Install(); err != nil {
				t.Fatal(err)
			}
			if again := snapshot(t, e.confDir); again[tc.primary] != installed[tc.primary] {
				t.Error("a second Install rewrote the configuration")
			}

			uninstallRestores(t, e, inst, original)
		})
	}
}

// uninstallRestores runs Uninstall and checks that the conf dir holds
// exactly the files it held before the install, with their bytes, and that
// both binaries are gone.
func uninstallRestores(t *testing.T, e *env, inst *cniinstall.Installer, original map[string]fileInfo) {
	t.Helper()
	if err := inst.Uninstall(); err != nil {
		t.Fatal(err)
	}
	after := snapshot(t, e.confDir)
	if len(after) != len(original) {
		t.Errorf("after Uninstall the dir has %d files, had %d", len(after), len(original))
	}
	for name, f := range original {
		if after[name].data != f.data {
			t.Errorf("Uninstall did not restore %s:\n%s\nwant:\n%s", name, after[name].data, f.data)
		}
	}
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		if _, err := os.Stat(filepath.Join(e.binDir, name)); !os.IsNotExist(err) {
			t.Errorf("Uninstall left %s", name)
		}
	}
}

func TestInstallReplacesAMisplacedOrStaleEntry(t *testing.T) {
	e := newEnv(t, "")
	stale := `{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"inpod-cni","agentSocket":"/old.sock"},{"type":"ptp"},{"type":"inpod-cni"}]}`
	os.WriteFile(filepath.Join(e.confDir, "10-n.conflist"), []byte(stale), 0o644)
	inst := e.installer(t, nil)
	if st := inst.Check(); st.Installed {
		t.Fatal("Check passed a config with a misplaced entry")
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(filepath.Join(e.confDir, "10-n.conflist"))
	if strings.Count(string(data), `"inpod-cni"`) != 1 || strings.Contains(string(data), "/old.sock") ||
		strings.Index(string(data), `"ptp"`) > strings.Index(string(data), `"inpod-cni"`) {
		t.Fatalf("entry not moved last and deduplicated:\n%s", data)
	}
}

func TestBinaryIsReplacedWhenDifferent(t *testing.T) {
	e := newEnv(t, "cilium")
	os.MkdirAll(e.binDir, 0o755)
	os.WriteFile(filepath.Join(e.binDir, "inpod-cni"), []byte("old version"), 0o755)
	inst := e.installer(t, nil)
	if st := inst.Check(); st.Installed || !strings.Contains(st.Reason, "differs") {
		t.Fatalf("Check with an old binary = %+v", st)
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(e.binDir, "inpod-cni"))
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("binary %v, %v", fi, err)
	}
	if leftovers, _ := filepath.Glob(filepath.Join(e.binDir, ".inpod-tmp-*")); len(leftovers) > 0 {
		t.Fatalf("temp files left: %v", leftovers)
	}
}

type change struct {
	installed bool
	reason    string
}

func runInstaller(t *testing.T, e *env, mod func(*cniinstall.Config)) <-chan change {
	t.Helper()
	changes := make(chan change, 32)
	inst := e.installer(t, func(c *cniinstall.Config) {
		c.OnChange = func(installed bool, reason string) { changes <- change{installed, reason} }
		if mod != nil {
			mod(c)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- inst.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return changes
}

func expectChange(t *testing.T, changes <-chan change, installed bool) change {
	t.Helper()
	select {
	case c := <-changes:
		if c.installed != installed {
			t.Fatalf("readiness reported installed=%v (%s), want %v", c.installed, c.reason, installed)
		}
		return c
	case <-time.After(10 * time.Second):
		t.Fatalf("no readiness change to installed=%v", installed)
	}
	return change{}
}

func TestRunRepairsAClobberedConfigAndReportsIt(t *testing.T) {
	e := newEnv(t, "calico")
	original, _ := os.ReadFile(filepath.Join(e.confDir, "10-calico.conflist"))
	changes := runInstaller(t, e, nil)
	// First the check finds nothing installed, then the install succeeds.
	expectChange(t, changes, false)
	expectChange(t, changes, true)

	// "Another CNI" rewrites its file without inpod.
	if err := os.WriteFile(filepath.Join(e.confDir, "10-calico.conflist"), original, 0o644); err != nil {
		t.Fatal(err)
	}
	c := expectChange(t, changes, false)
	if !strings.Contains(c.reason, "10-calico.conflist") {
		t.Errorf("reason %q does not name the file", c.reason)
	}
	expectChange(t, changes, true)
	data, _ := os.ReadFile(filepath.Join(e.confDir, "10-calico.conflist"))
	if !strings.Contains(string(data), `"inpod-cni"`) {
		t.Fatal("reported installed but the file lacks inpod")
	}

	// A binary removed: not ready until it is back.
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		os.Remove(filepath.Join(e.binDir, name))
		if c := expectChange(t, changes, false); !strings.Contains(c.reason, name) {
			t.Errorf("reason %q does not name %s", c.reason, name)
		}
		expectChange(t, changes, true)
	}
}

func TestNewRefusesAnIncompleteImage(t *testing.T) {
	e := newEnv(t, "")
	os.Remove(filepath.Join(e.source, "inpod-cni-apicheck"))
	_, err := cniinstall.New(cniinstall.Config{SourceDir: e.source, BinDir: e.binDir, ConfDir: e.confDir, StateDir: e.stateDir, Entry: entry})
	if err == nil || !strings.Contains(err.Error(), "inpod-cni-apicheck") {
		t.Fatalf("New with the companion binary missing: %v", err)
	}
}

func TestRunWaitsForAPrimaryConfig(t *testing.T) {
	e := newEnv(t, "")
	changes := runInstaller(t, e, nil)
	if c := expectChange(t, changes, false); c.reason == "" {
		t.Fatal("not-installed reported without a reason")
	}
	os.WriteFile(filepath.Join(e.confDir, "10-late.conflist"),
		[]byte(`{"cniVersion":"1.0.0","name":"late","plugins":[{"type":"bridge"}]}`), 0o644)
	expectChange(t, changes, true)
}

func TestRunStopsRepairingWhenSomethingKeepsRewriting(t *testing.T) {
	e := newEnv(t, "cilium")
	original, _ := os.ReadFile(filepath.Join(e.confDir, "05-cilium.conflist"))
	changes := runInstaller(t, e, func(c *cniinstall.Config) { c.MaxRepairsPerMinute = 2 })
	expectChange(t, changes, false)
	expectChange(t, changes, true) // repair 1 (the install)
	os.WriteFile(filepath.Join(e.confDir, "05-cilium.conflist"), original, 0o644)
	expectChange(t, changes, false)
	expectChange(t, changes, true) // repair 2
	os.WriteFile(filepath.Join(e.confDir, "05-cilium.conflist"), original, 0o644)
	expectChange(t, changes, false)
	// The budget is spent: the file stays as the other CNI wrote it, and
	// the node stays not ready, until the minute has passed.
	inst := e.installer(t, nil)
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if inst.Check().Installed {
			t.Fatal("repaired beyond the per-minute budget")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The agent holds its installer for its whole life and checks every 30 s:
// neither may cost the binaries' size in memory (~9 MiB for the real ones,
// most of the agent's heap when it held them and read them on each check).
func TestInstallerHoldsNoCopyOfTheBinaries(t *testing.T) {
	e := newEnv(t, "cilium")
	const size = 8 << 20
	big := make([]byte, size)
	for i := range big {
		big[i] = byte(i * 7)
	}
	for _, name := range []string{"inpod-cni", "inpod-cni-apicheck"} {
		if err := os.WriteFile(filepath.Join(e.source, name), big, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	heap := func() uint64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	inst := e.installer(t, nil)
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	if held := int64(heap()) - int64(before); held > size/4 {
		t.Errorf("the installer holds %d KiB after installing 2 binaries of %d KiB", held>>10, size>>10)
	}
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	if st := inst.Check(); !st.Installed {
		t.Fatalf("Check after Install = %+v", st)
	}
	runtime.ReadMemStats(&m1)
	if alloc := m1.TotalAlloc - m0.TotalAlloc; alloc > size/4 {
		t.Errorf("a check allocated %d KiB for 2 binaries of %d KiB", alloc>>10, size>>10)
	}
	runtime.KeepAlive(inst)
}

// A binary tampered with in place, at its own size, is found by its digest
// (the size alone says nothing), closes readiness and is written back.
func TestSameSizeTamperedBinaryIsDetectedAndRewritten(t *testing.T) {
	e := newEnv(t, "cilium")
	inst := e.installer(t, nil)
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(filepath.Join(e.source, "inpod-cni"))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(e.binDir, "inpod-cni")
	tampered := append([]byte(nil), want...)
	tampered[len(tampered)/2] ^= 0xff
	if err := os.WriteFile(bin, tampered, 0o755); err != nil {
		t.Fatal(err)
	}
	if st := inst.Check(); st.Installed || !strings.Contains(st.Reason, "differs") {
		t.Fatalf("Check with a same-size tampered binary = %+v", st)
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	if have, err := os.ReadFile(bin); err != nil || !bytes.Equal(have, want) {
		t.Fatalf("the tampered binary was not written back (%v)", err)
	}
	if st := inst.Check(); !st.Installed {
		t.Fatalf("Check after the repair = %+v", st)
	}
}
