package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

// confExtensions are the files runtimes read from the conf dir, in the
// order libcni considers them.
var confExtensions = []string{".conf", ".conflist", ".json"}

// conflist is a network configuration list kept as raw JSON, so every other
// plugin's entry and every top-level field survives byte for byte.
type conflist struct {
	top     map[string]json.RawMessage
	plugins []json.RawMessage
	// fromConf: the file was a single-plugin .conf/.json, converted.
	fromConf bool
}

// parseConfFile reads a .conflist, or a single-plugin .conf/.json as a
// one-element list.
func parseConfFile(data []byte) (*conflist, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	if raw, ok := top["plugins"]; ok {
		var plugins []json.RawMessage
		if err := json.Unmarshal(raw, &plugins); err != nil {
			return nil, fmt.Errorf("field \"plugins\" is not a list: %w", err)
		}
		if len(plugins) == 0 {
			return nil, errors.New("field \"plugins\" is empty")
		}
		for i, p := range plugins {
			if pluginType(p) == "" {
				return nil, fmt.Errorf("plugin %d has no \"type\"", i)
			}
		}
		if _, ok := top["name"]; !ok {
			return nil, errors.New("no \"name\"")
		}
		return &conflist{top: top, plugins: plugins}, nil
	}
	if pluginType(data) == "" {
		return nil, errors.New("no \"type\" and no \"plugins\"")
	}
	// A bare .conf: cniVersion and name move to the list, the rest is the
	// plugin.
	list := map[string]json.RawMessage{}
	plugin := map[string]json.RawMessage{}
	for k, v := range top {
		switch k {
		case "cniVersion", "name":
			list[k] = v
		default:
			plugin[k] = v
		}
	}
	if _, ok := list["name"]; !ok {
		return nil, errors.New("no \"name\"")
	}
	p, err := json.Marshal(plugin)
	if err != nil {
		return nil, err
	}
	return &conflist{top: list, plugins: []json.RawMessage{p}, fromConf: true}, nil
}

func pluginType(p json.RawMessage) string {
	var t struct {
		Type string `json:"type"`
	}
	json.Unmarshal(p, &t)
	return t.Type
}

// withEntry returns the list with every inpod entry removed and entry
// appended last.
func (c *conflist) withEntry(entry json.RawMessage) *conflist {
	out := c.without()
	if entry != nil {
		out.plugins = append(out.plugins, entry)
	}
	return out
}

func (c *conflist) without() *conflist {
	out := &conflist{top: c.top, fromConf: c.fromConf}
	for _, p := range c.plugins {
		if pluginType(p) != PluginType {
			out.plugins = append(out.plugins, p)
		}
	}
	return out
}

// hasEntryLast reports whether entry is the last plugin and the only inpod
// one.
func (c *conflist) hasEntryLast(entry json.RawMessage) bool {
	n := 0
	for _, p := range c.plugins {
		if pluginType(p) == PluginType {
			n++
		}
	}
	return n == 1 && jsonEqual(c.plugins[len(c.plugins)-1], entry)
}

func (c *conflist) marshal() ([]byte, error) {
	top := map[string]json.RawMessage{}
	for k, v := range c.top {
		top[k] = v
	}
	plugins, err := json.Marshal(c.plugins)
	if err != nil {
		return nil, err
	}
	top["plugins"] = plugins
	var buf bytes.Buffer
	raw, err := json.Marshal(top)
	if err != nil {
		return nil, err
	}
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		return nil, err
	}
	buf.WriteByte('\n')
	return buf.Bytes(), nil
}

// jsonEqual compares two JSON documents by value. Numbers compare by their
// text: as float64 one out of range (1e400, valid JSON) made a document
// unequal to itself, so Uninstall never recognised such a file's original.
func jsonEqual(a, b []byte) bool {
	decode := func(data []byte, v *any) error {
		d := json.NewDecoder(bytes.NewReader(data))
		d.UseNumber()
		if err := d.Decode(v); err != nil {
			return err
		}
		if d.More() {
			return errors.New("trailing data")
		}
		return nil
	}
	var x, y any
	if decode(a, &x) != nil || decode(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// primaryConfig finds the file a runtime would use: the lexicographically
// first file with a CNI extension that parses as a valid configuration,
// not counting the files named skip (inpod's own, when finding the
// primary's).
func primaryConfig(dir string, skip ...string) (string, *conflist, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", nil, err
	}
	var names []string
	for _, e := range entries {
		if e.Type().IsRegular() || e.Type()&os.ModeSymlink != 0 {
			for _, ext := range confExtensions {
				if filepath.Ext(e.Name()) == ext {
					names = append(names, e.Name())
				}
			}
		}
	}
	sort.Strings(names)
	var skipped []string
	for _, name := range names {
		if slices.Contains(skip, name) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		list, err := parseConfFile(data)
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		return filepath.Join(dir, name), list, nil
	}
	if len(skipped) > 0 {
		return "", nil, fmt.Errorf("%w in %s (skipped: %s)", errNoConfig, dir, strings.Join(skipped, "; "))
	}
	return "", nil, fmt.Errorf("%w in %s", errNoConfig, dir)
}

var errNoConfig = errors.New("no valid CNI configuration")
