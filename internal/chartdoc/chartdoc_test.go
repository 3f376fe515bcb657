package chartdoc

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/chart/README.md")

const fixture = "testdata/chart"

func readFixture(t *testing.T) Files {
	t.Helper()
	f, err := ReadFiles(fixture)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestValues(t *testing.T) {
	f := readFixture(t)
	values, err := Values(f.Values, f.Schema)
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string]Value{}
	var keys []string
	for _, v := range values {
		byKey[v.Key] = v
		keys = append(keys, v.Key)
	}
	// values.yaml's order; sections (maps with schema properties) before
	// their keys, and only when commented; the document's comment nowhere.
	wantKeys := []string{"modes", "agent", "agent.logLevel", "agent.port", "agent.image.repository", "agent.image.tag",
		"agent.podLabels", "agent.resources", "agent.maxUnavailable", "mode"}
	if !slices.Equal(keys, wantKeys) {
		t.Fatalf("keys:\n  got  %q\n  want %q", keys, wantKeys)
	}
	for _, tc := range []struct {
		key  string
		want Value
	}{
		{"modes", Value{Type: "list of string", Allowed: []string{"fast", "slow"}, Default: `["fast"]`,
			Description: "Which modes run, a list:<br>`fast` the quick one<br>`slow` the careful one, which takes longer"}},
		{"agent", Value{Section: true, Description: "The agent."}},
		{"agent.logLevel", Value{Type: "string", Allowed: []string{"debug", "info"}, Default: `"info"`, Description: "Its log level."}},
		{"agent.port", Value{Type: "integer, 1 to 65535", Default: "8080", Description: "The port it listens on."}},
		{"agent.image.repository", Value{Type: "string", Default: `"example.com/agent"`, Description: "The image, without its tag."}},
		{"agent.image.tag", Value{Type: "string", Default: `""`, Description: "Default: the chart's appVersion."}},
		// Free-form maps are one row, their default the whole map;
		// '<' and '|' escaped for the table.
		{"agent.podLabels", Value{Type: "object", Default: "{}", Description: `Labels for its pods, e.g. {team: &lt;name&gt;}; a\|b.`}},
		// No comment: the schema's description.
		{"agent.resources", Value{Type: "object", Default: `{"requests":{"cpu":"10m"}}`, Description: "the container's resources"}},
		// A comment at the end of the line; a list of types.
		{"agent.maxUnavailable", Value{Type: "integer or string, at least 1", Default: "1", Description: "Nodes at once."}},
		{"mode", Value{Type: "string", Default: `"a"`, Description: "the mode, from the schema"}},
	} {
		t.Run(tc.key, func(t *testing.T) {
			got := byKey[tc.key]
			tc.want.Key = tc.key
			if got.Key != tc.want.Key || got.Section != tc.want.Section || got.Type != tc.want.Type ||
				!slices.Equal(got.Allowed, tc.want.Allowed) || got.Default != tc.want.Default || got.Description != tc.want.Description {
				t.Errorf("\n got  %+v\n want %+v", got, tc.want)
			}
		})
	}
}

func TestValuesProblems(t *testing.T) {
	const schema = `{"type": "object", "properties": {
		"a": {"type": "string"},
		"b": {"type": "object", "properties": {"c": {"type": "integer"}, "d": {"type": "integer", "description": "d, by the schema"}}}
	}}`
	for _, tc := range []struct {
		name   string
		values string
		want   []string
	}{
		{"documented", "# A.\na: x\nb:\n  # C.\n  c: 1\n  d: 2\n", nil},
		{"no description", "a: x\nb:\n  c: 1\n  d: 2\n", []string{
			"values.yaml: a has no description",
			"values.yaml: b.c has no description",
		}},
		{"not in the schema", "# A.\na: x\nb:\n  # C.\n  c: 1\n  d: 2\n  # E.\n  e: 3\n# F.\nf: 4\n", []string{
			"values.yaml: b.e is not in values.schema.json",
			"values.yaml: f is not in values.schema.json",
		}},
		{"not in values.yaml", "# A.\na: x\nb:\n  # C.\n  c: 1\n", []string{
			"values.schema.json: b.d is not in values.yaml",
		}},
		{"a map in the schema, not in values.yaml", "# A.\na: x\n# B.\nb: 1\n", []string{
			"values.yaml: b is not a map, but values.schema.json gives it properties",
		}},
		{"every offender", "a: x\nb:\n  e: 3\n", []string{
			"values.yaml: a has no description",
			"values.yaml: b.e is not in values.schema.json",
			"values.schema.json: b.c is not in values.yaml",
			"values.schema.json: b.d is not in values.yaml",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Values([]byte(tc.values), []byte(schema))
			if tc.want == nil {
				if err != nil {
					t.Fatalf("want no error, got %v", err)
				}
				return
			}
			var pe *ProblemsError
			if !errors.As(err, &pe) {
				t.Fatalf("want a ProblemsError, got %v", err)
			}
			if len(pe.Problems) != len(tc.want) {
				t.Fatalf("got %d problems, want %d:\n%v", len(pe.Problems), len(tc.want), err)
			}
			for i, w := range tc.want {
				if !strings.HasPrefix(pe.Problems[i], w) {
					t.Errorf("problem %d: got %q, want it to start with %q", i, pe.Problems[i], w)
				}
			}
			if !strings.Contains(err.Error(), pe.Problems[0]) {
				t.Errorf("the error does not list the problems: %v", err)
			}
		})
	}
}

func TestTable(t *testing.T) {
	got := Table([]Value{
		{Key: "s", Section: true, Description: "A section."},
		{Key: "s.mode", Type: "string", Allowed: []string{"a", "b"}, Default: `"a"`, Description: "The mode."},
		{Key: "s.sep", Type: "string", Default: `"a|b"`, Description: "A separator."},
	})
	want := "| Key | Type | Default | Description |\n|---|---|---|---|\n" +
		"| `s` | section | | A section. |\n" +
		"| `s.mode` | string<br>one of `a`, `b` | `\"a\"` | The mode. |\n" +
		"| `s.sep` | string | `\"a\\|b\"` | A separator. |\n"
	if got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
}

// The fixture's README (testdata/chart/README.md) is what Generate writes;
// go test -update rewrites it.
func TestGenerate(t *testing.T) {
	got, err := Generate(readFixture(t))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(fixture, ReadmeFile)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("Generate differs from %s (go test -update rewrites it):\n%s", path, got)
	}
	for _, w := range []string{Generated, "# demo\n", "Version 1.2.3, app 4.5.6, https://example.com/demo.",
		"| `agent.port` | integer, 1 to 65535 | `8080` | The port it listens on. |"} {
		if !strings.Contains(string(got), w) {
			t.Errorf("the README lacks %q", w)
		}
	}
	// Deterministic: the same files, the same bytes.
	again, err := Generate(readFixture(t))
	if err != nil || string(again) != string(got) {
		t.Errorf("a second Generate differs (err %v)", err)
	}
}

func TestGenerateFailsOnAnUndocumentedValue(t *testing.T) {
	f := readFixture(t)
	f.Values = []byte(strings.Replace(string(f.Values), "  # The port it listens on.\n", "", 1))
	_, err := Generate(f)
	if err == nil || !strings.Contains(err.Error(), "agent.port has no description") {
		t.Fatalf("want agent.port named as undocumented, got %v", err)
	}
}

func copyFixture(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{ChartFile, ValuesFile, SchemaFile, TemplateFile, ReadmeFile} {
		b, err := os.ReadFile(filepath.Join(fixture, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, dir string)
		want   string // in the error; "" for none
	}{
		{"current", func(*testing.T, string) {}, ""},
		{"README edited by hand", func(t *testing.T, dir string) {
			edit(t, filepath.Join(dir, ReadmeFile), "The port it listens on.", "The port.")
		}, "first difference at line"},
		{"a comment changed in values.yaml", func(t *testing.T, dir string) {
			edit(t, filepath.Join(dir, ValuesFile), "# Its log level.", "# How much it says.")
		}, "want: | `agent.logLevel` | string<br>one of `debug`, `info` | `\"info\"` | How much it says. |"},
		{"a default changed in values.yaml", func(t *testing.T, dir string) {
			edit(t, filepath.Join(dir, ValuesFile), "port: 8080", "port: 9090")
		}, "`9090`"},
		{"README missing", func(t *testing.T, dir string) {
			if err := os.Remove(filepath.Join(dir, ReadmeFile)); err != nil {
				t.Fatal(err)
			}
		}, "missing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := copyFixture(t)
			tc.change(t, dir)
			err := Check(dir)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("want no error, got %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("want the README reported stale, got no error")
			}
			stale := filepath.Join(dir, ReadmeFile) + " is stale: run make chart-docs"
			if !errors.Is(err, ErrStale) || !strings.HasPrefix(err.Error(), stale) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want an error starting %q and containing %q, got:\n%v", stale, tc.want, err)
			}
			// make chart-docs mends it.
			if err := Write(dir); err != nil {
				t.Fatal(err)
			}
			if err := Check(dir); err != nil {
				t.Fatalf("after Write: %v", err)
			}
		})
	}
}

func TestCheckFailsOnAnUndocumentedValue(t *testing.T) {
	dir := copyFixture(t)
	edit(t, filepath.Join(dir, SchemaFile), `"mode": {"type": "string", "description": "the mode, from the schema"}`, `"mode": {"type": "string"}`)
	err := Check(dir)
	if err == nil || errors.Is(err, ErrStale) || !strings.Contains(err.Error(), "values.yaml: mode has no description") {
		t.Fatalf("want mode named as undocumented, got %v", err)
	}
}

func edit(t *testing.T, path, old, new string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		t.Fatalf("%s lacks %q", path, old)
	}
	if err := os.WriteFile(path, []byte(strings.Replace(string(b), old, new, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
}
