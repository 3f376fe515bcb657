// Package chartdoc writes a Helm chart's README from the chart itself, so
// the document cannot say something the chart does not: Chart.yaml gives
// the name and versions, README.md.gotmpl the prose, and the table of values
// has one row per value of values.yaml (its dotted key, its default), typed
// by values.schema.json (type, allowed values, bounds) and described by its
// comment in values.yaml, or else by its description in the schema. A map
// the schema gives properties of its own is a section: each of its keys is
// a row, and its own comment (if any) a row before them.
//
// Every value must be described, and values.yaml and values.schema.json
// must name the same values; Generate fails listing every offender. Check
// compares the committed README with what Generate writes (make check-chart
// runs it; make chart-docs runs Write).
package chartdoc

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/template"

	"go.yaml.in/yaml/v3"
)

// The chart's files Generate reads, and the one it writes, in the chart's
// directory.
const (
	ChartFile    = "Chart.yaml"
	ValuesFile   = "values.yaml"
	SchemaFile   = "values.schema.json"
	TemplateFile = "README.md.gotmpl"
	ReadmeFile   = "README.md"
)

// Files holds the contents of the chart's files Generate reads.
type Files struct {
	Chart, Values, Schema, Template []byte
}

// ReadFiles reads Files from the chart directory dir.
func ReadFiles(dir string) (Files, error) {
	var f Files
	for _, r := range []struct {
		name string
		dst  *[]byte
	}{{ChartFile, &f.Chart}, {ValuesFile, &f.Values}, {SchemaFile, &f.Schema}, {TemplateFile, &f.Template}} {
		b, err := os.ReadFile(filepath.Join(dir, r.name))
		if err != nil {
			return Files{}, err
		}
		*r.dst = b
	}
	return f, nil
}

// Chart is what the README takes from Chart.yaml.
type Chart struct {
	Name        string `yaml:"name"`
	Description string `yaml:"description"`
	Version     string `yaml:"version"`
	AppVersion  string `yaml:"appVersion"`
	Home        string `yaml:"home"`
}

// Value is one row of the values table.
type Value struct {
	// Key is the value's dotted path, as --set spells it.
	Key string
	// Section: a map whose keys are rows of their own; Type, Default and
	// Allowed are empty.
	Section bool
	// Type is the schema's type ("string", "integer or string", "list of
	// string"), with its bounds ("integer, 1 to 65535"); values.yaml's
	// where the schema gives none.
	Type string
	// Allowed lists the schema's enum (of the items, for a list).
	Allowed []string
	// Default is the value in values.yaml, as JSON.
	Default string
	// Description is the comment above the value in values.yaml, else the
	// schema's description, as one line of Markdown.
	Description string
}

// ProblemsError lists every value Values could not document, in
// values.yaml's order.
type ProblemsError struct {
	Problems []string
}

func (e *ProblemsError) Error() string {
	n := fmt.Sprintf("%d problems", len(e.Problems))
	if len(e.Problems) == 1 {
		n = "1 problem"
	}
	return fmt.Sprintf("not every value is documented (%s):\n  %s", n, strings.Join(e.Problems, "\n  "))
}

// schema is the part of a JSON schema the table shows.
type schema struct {
	Type        typeList           `json:"type"`
	Description string             `json:"description"`
	Enum        []any              `json:"enum"`
	Properties  map[string]*schema `json:"properties"`
	Items       *schema            `json:"items"`
	Minimum     *float64           `json:"minimum"`
	Maximum     *float64           `json:"maximum"`
}

// typeList is a schema's "type": one name or a list of them.
type typeList []string

func (t *typeList) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*t = typeList{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return fmt.Errorf("type: want a string or a list of strings: %w", err)
	}
	*t = many
	return nil
}

// Values lists the rows of the values table: every value of values.yaml in
// its order, checked against the schema.
func Values(valuesYAML, schemaJSON []byte) ([]Value, error) {
	var root schema
	if err := json.Unmarshal(schemaJSON, &root); err != nil {
		return nil, fmt.Errorf("%s: %w", SchemaFile, err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(valuesYAML, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", ValuesFile, err)
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s: want a map of values", ValuesFile)
	}
	w := walker{}
	w.mapping("", doc.Content[0], &root)
	if len(w.problems) > 0 {
		return nil, &ProblemsError{Problems: w.problems}
	}
	return w.values, nil
}

type walker struct {
	values   []Value
	problems []string
}

func (w *walker) problem(format string, args ...any) {
	w.problems = append(w.problems, fmt.Sprintf(format, args...))
}

// mapping walks the keys of m, a map whose schema s names its properties.
func (w *walker) mapping(prefix string, m *yaml.Node, s *schema) {
	seen := map[string]bool{}
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		key := k.Value
		if prefix != "" {
			key = prefix + "." + key
		}
		seen[k.Value] = true
		ps, ok := s.Properties[k.Value]
		if !ok {
			w.problem("%s: %s is not in %s", ValuesFile, key, SchemaFile)
			continue
		}
		if v.Kind == yaml.AliasNode {
			v = v.Alias
		}
		desc := description(comment(k, v))
		if ps.Properties != nil {
			if v.Kind != yaml.MappingNode {
				w.problem("%s: %s is not a map, but %s gives it properties", ValuesFile, key, SchemaFile)
				continue
			}
			if desc == "" {
				desc = description(ps.Description)
			}
			if desc != "" {
				w.values = append(w.values, Value{Key: key, Section: true, Description: desc})
			}
			w.mapping(key, v, ps)
			continue
		}
		if desc == "" {
			desc = description(ps.Description)
		}
		if desc == "" {
			w.problem("%s: %s has no description: add a comment above it in %s (or a description in %s)", ValuesFile, key, ValuesFile, SchemaFile)
			continue
		}
		w.values = append(w.values, Value{
			Key:         key,
			Type:        typeOf(ps, v),
			Allowed:     allowed(ps),
			Default:     toJSON(v),
			Description: desc,
		})
	}
	var missing []string
	for name := range s.Properties {
		if !seen[name] {
			missing = append(missing, name)
		}
	}
	slices.Sort(missing)
	for _, name := range missing {
		key := name
		if prefix != "" {
			key = prefix + "." + name
		}
		w.problem("%s: %s is not in %s", SchemaFile, key, ValuesFile)
	}
}

// comment is what values.yaml says of a key: the comment lines above it
// and a comment at the end of its line, without their '#'.
func comment(k, v *yaml.Node) string {
	var lines []string
	for _, c := range []string{k.HeadComment, k.LineComment, v.LineComment} {
		for l := range strings.Lines(c) {
			l = strings.TrimRight(l, " \t\r\n")
			l = strings.TrimPrefix(strings.TrimLeft(l, " \t"), "#")
			l = strings.TrimPrefix(l, " ")
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}

// defItem is an indented line of a definition list in a comment: a term,
// two or more spaces, its definition.
var defItem = regexp.MustCompile(`^\s+(\S+)\s{2,}(\S.*)$`)

// description turns a comment into one line of Markdown for a table cell.
// Lines join with a space, except that an item of an indented definition
// list ("  term    what it means") and a line indented less than the one
// before it (the next item of a list whose items are continued indented)
// start a new line (<br>).
func description(text string) string {
	var b strings.Builder
	prevIndent := 0
	for i, l := range strings.Split(strings.TrimSpace(text), "\n") {
		if strings.TrimSpace(l) == "" {
			if i > 0 {
				b.WriteString("<br>")
			}
			prevIndent = 0
			continue
		}
		indent := len(l) - len(strings.TrimLeft(l, " \t"))
		m := defItem.FindStringSubmatch(l)
		switch {
		case i == 0:
		case m != nil || indent < prevIndent:
			b.WriteString("<br>")
		default:
			b.WriteString(" ")
		}
		if m != nil {
			b.WriteString(code(m[1]) + " " + escape(strings.Join(strings.Fields(m[2]), " ")))
		} else {
			b.WriteString(escape(strings.Join(strings.Fields(l), " ")))
		}
		prevIndent = indent
	}
	return strings.TrimSuffix(b.String(), "<br>")
}

// escape makes text safe in a Markdown table cell: '|' escaped everywhere
// (code spans included, as GFM tables require), '<' and '>' outside code
// spans so that "<namespace>" is not taken for HTML.
func escape(text string) string {
	var b strings.Builder
	inCode := false
	for _, r := range text {
		switch {
		case r == '`':
			inCode = !inCode
			b.WriteRune(r)
		case r == '|':
			b.WriteString(`\|`)
		case r == '<' && !inCode:
			b.WriteString("&lt;")
		case r == '>' && !inCode:
			b.WriteString("&gt;")
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// code is s as a Markdown code span in a table cell.
func code(s string) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	if strings.Contains(s, "`") {
		return "`` " + s + " ``"
	}
	return "`" + s + "`"
}

// typeOf is the schema's type of a value with its bounds, or the YAML type
// of v where the schema names none.
func typeOf(s *schema, v *yaml.Node) string {
	t := typeName(s, v)
	var bounds string
	switch {
	case s.Minimum != nil && s.Maximum != nil:
		bounds = number(*s.Minimum) + " to " + number(*s.Maximum)
	case s.Minimum != nil:
		bounds = "at least " + number(*s.Minimum)
	case s.Maximum != nil:
		bounds = "at most " + number(*s.Maximum)
	}
	if bounds != "" {
		t += ", " + bounds
	}
	return t
}

func typeName(s *schema, v *yaml.Node) string {
	if len(s.Type) == 0 {
		return yamlType(v)
	}
	names := make([]string, len(s.Type))
	for i, n := range s.Type {
		if n == "array" {
			n = "list"
			if s.Items != nil && len(s.Items.Type) > 0 {
				n += " of " + strings.Join(s.Items.Type, " or ")
			}
		}
		names[i] = n
	}
	return strings.Join(names, " or ")
}

func yamlType(v *yaml.Node) string {
	switch v.Kind {
	case yaml.SequenceNode:
		return "list"
	case yaml.MappingNode:
		return "object"
	}
	switch v.ShortTag() {
	case "!!str":
		return "string"
	case "!!int":
		return "integer"
	case "!!float":
		return "number"
	case "!!bool":
		return "boolean"
	}
	return "any"
}

func number(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// allowed is the schema's enum of a value, or of its items.
func allowed(s *schema) []string {
	enum := s.Enum
	if enum == nil && s.Items != nil {
		enum = s.Items.Enum
	}
	var out []string
	for _, e := range enum {
		out = append(out, fmt.Sprint(e))
	}
	return out
}

// toJSON renders a YAML value as compact JSON, keeping the order of map
// keys as values.yaml writes them.
func toJSON(n *yaml.Node) string {
	switch n.Kind {
	case yaml.AliasNode:
		return toJSON(n.Alias)
	case yaml.SequenceNode:
		items := make([]string, len(n.Content))
		for i, c := range n.Content {
			items[i] = toJSON(c)
		}
		return "[" + strings.Join(items, ",") + "]"
	case yaml.MappingNode:
		pairs := make([]string, 0, len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			pairs = append(pairs, jsonScalar(n.Content[i].Value)+":"+toJSON(n.Content[i+1]))
		}
		return "{" + strings.Join(pairs, ",") + "}"
	}
	var v any
	if err := n.Decode(&v); err != nil {
		return jsonScalar(n.Value)
	}
	return jsonScalar(v)
}

func jsonScalar(v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return fmt.Sprint(v)
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// Table renders values as a Markdown table: key, type, default,
// description.
func Table(values []Value) string {
	var b strings.Builder
	b.WriteString("| Key | Type | Default | Description |\n|---|---|---|---|\n")
	for _, v := range values {
		if v.Section {
			fmt.Fprintf(&b, "| %s | section | | %s |\n", code(v.Key), v.Description)
			continue
		}
		t := escape(v.Type)
		if len(v.Allowed) > 0 {
			one := make([]string, len(v.Allowed))
			for i, a := range v.Allowed {
				one[i] = code(a)
			}
			t += "<br>one of " + strings.Join(one, ", ")
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", code(v.Key), t, code(v.Default), v.Description)
	}
	return b.String()
}

// Generated opens every README Generate writes.
const Generated = "<!-- Generated by `make chart-docs` (internal/chartdoc) from Chart.yaml, README.md.gotmpl,\n" +
	"     values.yaml and values.schema.json: edit those, not this file. -->\n"

// Generate writes the README: Generated, then README.md.gotmpl executed
// with .Chart (Chart.yaml) and .Values (the Markdown table of values).
func Generate(f Files) ([]byte, error) {
	var chart Chart
	if err := yaml.Unmarshal(f.Chart, &chart); err != nil {
		return nil, fmt.Errorf("%s: %w", ChartFile, err)
	}
	values, err := Values(f.Values, f.Schema)
	if err != nil {
		return nil, err
	}
	tmpl, err := template.New(TemplateFile).Option("missingkey=error").Parse(string(f.Template))
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.WriteString(Generated)
	if err := tmpl.Execute(&b, struct {
		Chart  Chart
		Values string
	}{chart, Table(values)}); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// Write regenerates the README of the chart in dir.
func Write(dir string) error {
	want, err := generateDir(dir)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ReadmeFile), want, 0o644)
}

// ErrStale is what Check's error wraps when the README is not what
// Generate writes.
var ErrStale = errors.New("stale")

// Check fails when the README of the chart in dir is not what Generate
// writes, saying so and where the two first differ.
func Check(dir string) error {
	want, err := generateDir(dir)
	if err != nil {
		return err
	}
	path := filepath.Join(dir, ReadmeFile)
	have, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if bytes.Equal(have, want) {
		return nil
	}
	return fmt.Errorf("%s is %w: run make chart-docs\n  %s", path, ErrStale, firstDifference(have, want))
}

func generateDir(dir string) ([]byte, error) {
	f, err := ReadFiles(dir)
	if err != nil {
		return nil, err
	}
	out, err := Generate(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	return out, nil
}

// firstDifference says where have first differs from want, by line.
func firstDifference(have, want []byte) string {
	if len(have) == 0 {
		return "it is missing or empty"
	}
	h, w := strings.Split(string(have), "\n"), strings.Split(string(want), "\n")
	for i := 0; i < len(h) || i < len(w); i++ {
		var hl, wl string
		if i < len(h) {
			hl = h[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if hl != wl || i >= len(h) || i >= len(w) {
			return fmt.Sprintf("first difference at line %d:\n  have: %s\n  want: %s", i+1, clip(hl), clip(wl))
		}
	}
	return "they differ"
}

// clip shortens a line for an error message.
func clip(s string) string {
	if r := []rune(s); len(r) > 120 {
		return string(r[:120]) + "…"
	}
	return s
}
