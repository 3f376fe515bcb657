package cniinstall_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/agent/cniinstall"
	"github.com/inpod-dev/inpod/internal/testkit"
)

const ownedName = "00-inpod.conflist"

func owned(c *cniinstall.Config) { c.OwnedFile = ownedName }

func wantChain(t *testing.T, dir, file string, types ...string) {
	t.Helper()
	gotFile, got, err := testkit.RuntimeChain(dir)
	if err != nil {
		t.Fatal(err)
	}
	if gotFile != file || strings.Join(got, ",") != strings.Join(types, ",") {
		t.Fatalf("the runtime would use %s %v, want %s %v", gotFile, got, file, types)
	}
}

func TestOwnedCopiesThePrimaryAndLeavesItAlone(t *testing.T) {
	for _, tc := range []struct {
		name    string
		primary string
		types   []string
	}{
		{"calico", "10-calico.conflist", []string{"calico", "portmap", "bandwidth"}},
		{"cilium", "05-cilium.conflist", []string{"cilium-cni"}},
		{"bare-conf", "10-bridge.conf", []string{"bridge"}},
		{"several", "10-primary.conflist", []string{"ptp"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.name)
			original := snapshot(t, e.confDir)
			inst := e.installer(t, owned)
			st, err := inst.Install()
			if err != nil || !st.Installed || filepath.Base(st.Conflist) != ownedName {
				t.Fatalf("Install = %+v, %v; want installed into %s", st, err, ownedName)
			}
			wantChain(t, e.confDir, ownedName, append(tc.types, "inpod-cni")...)
			installed := snapshot(t, e.confDir)
			for name, f := range original {
				if installed[name] != f {
					t.Errorf("the owned mode changed %s", name)
				}
			}
			// The network keeps the primary's name and version: the
			// runtime's cache of a sandbox's result is keyed by it.
			var got, want map[string]any
			json.Unmarshal([]byte(installed[ownedName].data), &got)
			primary, _ := os.ReadFile(filepath.Join(e.confDir, tc.primary))
			json.Unmarshal(primary, &want)
			if got["name"] != want["name"] || got["cniVersion"] != want["cniVersion"] {
				t.Errorf("inpod's file has name %v version %v, the primary's %v %v", got["name"], got["cniVersion"], want["name"], want["cniVersion"])
			}
			if installed[ownedName].mode != 0o644 {
				t.Errorf("inpod's file has mode %v, want 0644", installed[ownedName].mode)
			}
			if st := inst.Check(); !st.Installed {
				t.Fatalf("Check after Install: %+v", st)
			}
			if _, err := inst.Install(); err != nil {
				t.Fatal(err)
			}
			if again := snapshot(t, e.confDir); again[ownedName] != installed[ownedName] {
				t.Error("a second Install rewrote inpod's file")
			}

			uninstallRestores(t, e, inst, original)
		})
	}
}

// The case the owned mode exists for: the agent away (no Run, no Install),
// the primary writes its file again. The runtime's chain still ends with
// inpod-cni; only a check by a returning agent finds the copy stale, and
// its install follows the primary again.
func TestOwnedChainSurvivesAPrimaryRewriteWithoutTheAgent(t *testing.T) {
	e := newEnv(t, "calico")
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	original, _ := os.ReadFile(primary)
	if _, err := e.installer(t, owned).Install(); err != nil {
		t.Fatal(err)
	}

	upgraded := strings.Replace(string(original), `"portmap"`, `"tuning"`, 1)
	if upgraded == string(original) {
		t.Fatal("the test's primary has no portmap to replace")
	}
	if err := os.WriteFile(primary, []byte(upgraded), 0o644); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, ownedName, "calico", "portmap", "bandwidth", "inpod-cni")

	back := e.installer(t, owned)
	if st := back.Check(); st.Installed || !strings.Contains(st.Reason, "10-calico.conflist") {
		t.Fatalf("a returning agent's Check of a stale copy = %+v, want not installed naming the primary", st)
	}
	if _, err := back.Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, ownedName, "calico", "tuning", "bandwidth", "inpod-cni")
	if data, _ := os.ReadFile(primary); string(data) != upgraded {
		t.Fatal("the install changed the primary's file")
	}
}

func TestOwnedNameThatSortsAfterThePrimaryIsNotInstalled(t *testing.T) {
	e := newEnv(t, "cilium")
	inst := e.installer(t, func(c *cniinstall.Config) { c.OwnedFile = "90-inpod.conflist" })
	st, err := inst.Install()
	if err == nil || st.Installed || !strings.Contains(st.Reason, "05-cilium.conflist") || !strings.Contains(st.Reason, "sort before") {
		t.Fatalf("Install with a name sorting last = %+v, %v; want not installed, naming the file the runtime uses", st, err)
	}
	if st := inst.Check(); st.Installed {
		t.Fatal("Check passed a file the runtime does not use")
	}
}

func TestNewRefusesAnOwnedNameOutsideTheConfDir(t *testing.T) {
	e := newEnv(t, "")
	for _, name := range []string{"../00-inpod.conflist", "00-inpod.conf", "sub/00-inpod.conflist"} {
		_, err := cniinstall.New(cniinstall.Config{SourceDir: e.source, BinDir: e.binDir, ConfDir: e.confDir,
			StateDir: e.stateDir, Entry: entry, OwnedFile: name})
		if err == nil {
			t.Errorf("New accepted the owned file name %q", name)
		}
	}
}

// Switching modes never leaves a moment where the runtime's chain lacks
// inpod-cni, and each mode takes over what the other left.
func TestModeSwitchesHandOverTheChain(t *testing.T) {
	e := newEnv(t, "calico")
	original := snapshot(t, e.confDir)
	if _, err := e.installer(t, nil).Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, "10-calico.conflist", "calico", "portmap", "bandwidth", "inpod-cni")

	toOwned := e.installer(t, owned)
	if st := toOwned.Check(); !st.Installed {
		// The chained entry still works, but owned mode wants its file.
		t.Logf("owned mode over a chained install: %s", st.Reason)
	}
	if _, err := toOwned.Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, ownedName, "calico", "portmap", "bandwidth", "inpod-cni")
	if got := snapshot(t, e.confDir)["10-calico.conflist"]; got.data != original["10-calico.conflist"].data {
		t.Fatalf("the owned mode left inpod in the primary's file:\n%s", got.data)
	}

	renamed := e.installer(t, func(c *cniinstall.Config) { c.OwnedFile = "01-inpod.conflist" })
	if _, err := renamed.Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, "01-inpod.conflist", "calico", "portmap", "bandwidth", "inpod-cni")
	if _, err := os.Stat(filepath.Join(e.confDir, ownedName)); !os.IsNotExist(err) {
		t.Fatal("a renamed owned file left the old one")
	}

	toChained := e.installer(t, nil)
	if st := toChained.Check(); st.Installed || !strings.Contains(st.Reason, "01-inpod.conflist") {
		t.Fatalf("chained mode's Check over an owned file = %+v, want not installed naming it", st)
	}
	if _, err := toChained.Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, "10-calico.conflist", "calico", "portmap", "bandwidth", "inpod-cni")
	if _, err := os.Stat(filepath.Join(e.confDir, "01-inpod.conflist")); !os.IsNotExist(err) {
		t.Fatal("the chained mode left the owned file")
	}
	if err := toChained.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, e.confDir); after["10-calico.conflist"].data != original["10-calico.conflist"].data || len(after) != len(original) {
		t.Fatal("Uninstall after the switches did not give back the original directory")
	}
}

// An uninstall by an agent in chained mode (the mode changed in the same
// upgrade as the removal) still removes the owned file it finds recorded.
func TestUninstallRemovesARecordedOwnedFile(t *testing.T) {
	e := newEnv(t, "cilium")
	original := snapshot(t, e.confDir)
	if _, err := e.installer(t, owned).Install(); err != nil {
		t.Fatal(err)
	}
	if err := e.installer(t, nil).Uninstall(); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, e.confDir); len(after) != len(original) {
		t.Fatalf("Uninstall left %d files, want the %d it found", len(after), len(original))
	}
}

func TestOwnedFileFollowsThePrimaryAndOutlivesItsRewrite(t *testing.T) {
	e := newEnv(t, "cilium")
	changes := runInstaller(t, e, owned)
	expectChange(t, changes, false)
	expectChange(t, changes, true)

	primary := filepath.Join(e.confDir, "05-cilium.conflist")
	data, _ := os.ReadFile(primary)
	// The primary changes its settings while the agent runs: the copy
	// follows, the node reported not ready until it has.
	if err := os.WriteFile(primary, []byte(strings.Replace(string(data), `"enable-debug":false`, `"enable-debug":true`, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	expectChange(t, changes, false)
	expectChange(t, changes, true)
	if copy, _ := os.ReadFile(filepath.Join(e.confDir, ownedName)); !strings.Contains(string(copy), `"enable-debug": true`) {
		t.Fatalf("inpod's file did not follow the primary's:\n%s", copy)
	}

	// The primary's file gone (an installer that deletes, then writes):
	// not installed, but inpod's file stays, so the runtime never picks
	// the primary's new file without inpod in between.
	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	if c := expectChange(t, changes, false); !strings.Contains(c.reason, "no valid CNI configuration") {
		t.Fatalf("reason %q", c.reason)
	}
	if err := os.WriteFile(primary, data, 0o644); err != nil {
		t.Fatal(err)
	}
	expectChange(t, changes, true)
	wantChain(t, e.confDir, ownedName, "cilium-cni", "inpod-cni")
}

// A switch to the owned mode with a name that sorts after the primary's
// leaves the primary's entry in place: the runtime keeps a chain with
// inpod-cni, and the node is reported not installed, naming the file.
func TestOwnedNameSortingLateKeepsTheChainedEntry(t *testing.T) {
	e := newEnv(t, "calico")
	if _, err := e.installer(t, nil).Install(); err != nil {
		t.Fatal(err)
	}
	late := e.installer(t, func(c *cniinstall.Config) { c.OwnedFile = "99-inpod.conflist" })
	if st, err := late.Install(); err == nil || st.Installed {
		t.Fatalf("Install with a late name = %+v, %v; want not installed", st, err)
	}
	wantChain(t, e.confDir, "10-calico.conflist", "calico", "portmap", "bandwidth", "inpod-cni")
}

// A renamed owned file is copied from the primary's, not from inpod's old
// copy (which sorts first), and the old copy goes.
func TestOwnedRenameCopiesThePrimary(t *testing.T) {
	e := newEnv(t, "calico")
	if _, err := e.installer(t, owned).Install(); err != nil {
		t.Fatal(err)
	}
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	data, _ := os.ReadFile(primary)
	if err := os.WriteFile(primary, []byte(strings.Replace(string(data), `"portmap"`, `"tuning"`, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	renamed := e.installer(t, func(c *cniinstall.Config) { c.OwnedFile = "01-inpod.conflist" })
	if _, err := renamed.Install(); err != nil {
		t.Fatal(err)
	}
	wantChain(t, e.confDir, "01-inpod.conflist", "calico", "tuning", "bandwidth", "inpod-cni")
	if _, err := os.Stat(filepath.Join(e.confDir, ownedName)); !os.IsNotExist(err) {
		t.Fatal("the old copy stayed")
	}
}

// An owned file name that is another CNI's file, by mistake, is refused:
// neither overwritten with a copy of some other file nor removed.
func TestOwnedNameOfAnotherCNIsFileIsRefused(t *testing.T) {
	e := newEnv(t, "several")
	original := snapshot(t, e.confDir)
	inst := e.installer(t, func(c *cniinstall.Config) { c.OwnedFile = "10-primary.conflist" })
	if st, err := inst.Install(); err == nil || st.Installed || !strings.Contains(st.Reason, "not inpod's") {
		t.Fatalf("Install over another CNI's file = %+v, %v; want refused", st, err)
	}
	if after := snapshot(t, e.confDir); after["10-primary.conflist"] != original["10-primary.conflist"] {
		t.Fatal("the other CNI's file was changed")
	}
	// Nor removed when no other configuration is left to copy, nor by an
	// uninstall.
	os.Remove(filepath.Join(e.confDir, "20-other.conflist"))
	inst.Install()
	if err := inst.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.confDir, "10-primary.conflist")); err != nil {
		t.Fatalf("the other CNI's file was removed: %v", err)
	}
}
