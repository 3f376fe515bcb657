package cniinstall

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// FuzzConflistChaining runs the conflist surgery on arbitrary CNI
// configuration files. For any file the installer would take as primary:
//   - inserting gives a file that parses, ends with inpod's entry (the only
//     inpod one), keeps every other plugin in order and every top-level field;
//   - inserting is idempotent (the result needs no further change, and a
//     second insert writes the same bytes);
//   - removing from the inserted file gives a file with exactly the other
//     plugins, which parses whenever there are any;
//   - the installer's own check agrees with the surgery.
func FuzzConflistChaining(f *testing.F) {
	for _, dir := range []string{"bare-conf", "calico", "cilium", "several"} {
		files, _ := filepath.Glob(filepath.Join("testdata", dir, "in", "*"))
		for _, p := range files {
			if data, err := os.ReadFile(p); err == nil {
				f.Add(data, "kube-system")
			}
		}
	}
	for _, seed := range []string{
		`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"bridge"},{"type":"inpod-cni","agentSocket":"/old"},{"type":"portmap"}]}`,
		`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"inpod-cni"}]}`,
		`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"inpod-cni"},{"type":"inpod-cni"},{"type":"x"}]}`,
		`{"cniVersion":"0.3.1","name":"n","type":"bridge","ipam":{"type":"host-local","ranges":[[{"subnet":"10.0.0.0/24"}]]}}`,
		`{"name":"n","type":"inpod-cni"}`,
		`{"name":"n","plugins":[{"type":"a","Type":"inpod-cni"}],"disableCheck":true,"x":"<&>"}`,
		`{"name":"n","plugins":[{"type":"a","dup":1,"dup":2}],"plugins":[{"type":"b"}]}`,
		`{"name":"n","plugins":[{"type":"a","n":1e400}]}`,
		`{"name":"n","plugins":null}`, `{"name":"n","plugins":[]}`, `[]`, `{}`,
	} {
		f.Add([]byte(seed), "")
	}
	f.Fuzz(func(t *testing.T, data []byte, exclude string) {
		e := Entry{AgentSocket: "/var/run/inpod/cni.sock", Timeout: "30s"}
		if exclude != "" {
			e.ExcludeNamespaces = []string{exclude}
		}
		entry, err := e.marshal()
		if err != nil {
			t.Fatal(err)
		}
		orig, err := parseConfFile(data)
		if err != nil {
			return
		}
		others := orig.without().plugins

		inserted, err := orig.withEntry(entry).marshal()
		if err != nil {
			t.Fatalf("insert: %v", err)
		}
		got, err := parseConfFile(inserted)
		if err != nil {
			t.Fatalf("inserted file does not parse: %v\n%s", err, inserted)
		}
		if got.fromConf || !got.hasEntryLast(entry) {
			t.Fatalf("inserted file does not end with the entry:\n%s", inserted)
		}
		samePlugins(t, "insert", got.without().plugins, others)
		for k, v := range orig.top {
			if k != "plugins" && !jsonEqual(got.top[k], v) {
				t.Fatalf("insert changed top-level %q: %s → %s", k, v, got.top[k])
			}
		}
		again, err := got.withEntry(entry).marshal()
		if err != nil || !bytes.Equal(again, inserted) {
			t.Fatalf("insert is not idempotent (%v):\n%s\n---\n%s", err, inserted, again)
		}

		removed, err := got.without().marshal()
		if err != nil {
			t.Fatalf("remove: %v", err)
		}
		if len(others) == 0 {
			return // nothing but inpod: no list left to parse
		}
		back, err := parseConfFile(removed)
		if err != nil {
			t.Fatalf("file with inpod removed does not parse: %v\n%s", err, removed)
		}
		if len(back.plugins) != len(back.without().plugins) {
			t.Fatalf("inpod left after removal:\n%s", removed)
		}
		samePlugins(t, "remove(insert)", back.plugins, others)
		if !sameList(back, orig.without()) {
			t.Fatalf("remove(insert(x)) differs from x without inpod:\n%s", removed)
		}
	})
}

func samePlugins(t *testing.T, what string, got, want []json.RawMessage) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d other plugins, want %d", what, len(got), len(want))
	}
	for i := range got {
		if !jsonEqual(got[i], want[i]) {
			t.Fatalf("%s changed plugin %d: %s → %s", what, i, want[i], got[i])
		}
	}
}

// A value jsonEqual could not decode (a number beyond float64, valid JSON)
// made a file unequal to itself, so Uninstall rewrote it instead of
// restoring the original bytes. Found by FuzzConflistChaining.
func TestUninstallRestoresAFileWithAHugeNumber(t *testing.T) {
	dir := t.TempDir()
	conf, bin, src := filepath.Join(dir, "net.d"), filepath.Join(dir, "bin"), filepath.Join(dir, "src")
	for _, d := range []string{conf, bin, src} {
		os.MkdirAll(d, 0o755)
	}
	for _, name := range binaries {
		os.WriteFile(filepath.Join(src, name), []byte("#!/bin/true\n"), 0o755)
	}
	original := []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge","mtu":1e400}]}`)
	path := filepath.Join(conf, "10-n.conflist")
	os.WriteFile(path, original, 0o644)
	inst, err := New(Config{SourceDir: src, BinDir: bin, ConfDir: conf, StateDir: filepath.Join(dir, "state")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inst.Install(); err != nil {
		t.Fatal(err)
	}
	if err := inst.Uninstall(); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, original) {
		t.Fatalf("Uninstall did not restore the original bytes:\n%s\nwant:\n%s", got, original)
	}
}
