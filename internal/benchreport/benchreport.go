// Package benchreport collects the figures the benchmarks measure into one
// report: make bench runs every benchmark with INPOD_BENCH_REPORT naming a
// file, each benchmark appends its figures to it (one JSON object a line,
// so benchmarks in separate test binaries add to the same file), and
// Render turns the file into the Markdown table the README links to.
//
// A figure carries the floor it is judged against, measured in the same
// run, so a report never compares numbers from different machines or
// moments.
package benchreport

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// EnvFile names the file benchmarks append their figures to. Unset (a
// plain go test -bench run), Record only logs.
const EnvFile = "INPOD_BENCH_REPORT"

// Figure is one measured value.
type Figure struct {
	// Section groups figures in the report ("ZDS", "Pod start-up").
	Section string `json:"section"`
	// Name says what was measured ("Add→Ack p50").
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	// Unit of Value and Floor: "ms", "µs", "MiB", "count".
	Unit string `json:"unit"`
	// Floor, when FloorName is set, is the baseline measured in the same
	// run; the report prints Value/Floor.
	FloorName string  `json:"floorName,omitempty"`
	Floor     float64 `json:"floor,omitempty"`
	// Target is the figure's goal as the issue states it ("≤ 1.2× floor").
	Target string `json:"target,omitempty"`
	// Source is the benchmark that measured it, filled in by Record.
	Source string `json:"source,omitempty"`
}

var mu sync.Mutex

// Record logs f and, when make bench asked for a report, appends it to the
// report file.
func Record(tb testing.TB, f Figure) {
	tb.Helper()
	if f.Source == "" {
		f.Source = tb.Name()
	}
	if f.FloorName != "" {
		tb.Logf("%s / %s: %s (%s %s, ratio %.2f)", f.Section, f.Name, format(f.Value, f.Unit), f.FloorName, format(f.Floor, f.Unit), ratio(f))
	} else {
		tb.Logf("%s / %s: %s", f.Section, f.Name, format(f.Value, f.Unit))
	}
	path := os.Getenv(EnvFile)
	if path == "" {
		return
	}
	line, err := json.Marshal(f)
	if err != nil {
		tb.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	file, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		tb.Fatalf("bench report: %v", err)
	}
	defer file.Close()
	if _, err := file.Write(append(line, '\n')); err != nil {
		tb.Fatalf("bench report: %v", err)
	}
}

// Read parses a report file. A line that does not parse is an error naming
// it: a truncated report must not pass for a complete one.
func Read(r io.Reader) ([]Figure, error) {
	var figures []Figure
	sc := bufio.NewScanner(r)
	n := 0
	for sc.Scan() {
		n++
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		var f Figure
		if err := json.Unmarshal(sc.Bytes(), &f); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		figures = append(figures, f)
	}
	return figures, sc.Err()
}

// Render writes the figures as Markdown: one table a section, sections and
// rows in the order they were recorded, the headline section first. A
// figure recorded twice (a benchmark run twice) keeps its last value.
func Render(w io.Writer, title, headline string, figures []Figure) error {
	type key struct{ section, name string }
	var sections []string
	rows := map[string][]key{}
	last := map[key]Figure{}
	for _, f := range figures {
		k := key{f.Section, f.Name}
		if _, seen := last[k]; !seen {
			if _, has := rows[f.Section]; !has {
				sections = append(sections, f.Section)
			}
			rows[f.Section] = append(rows[f.Section], k)
		}
		last[k] = f
	}
	for i, s := range sections {
		if s == headline && i > 0 {
			sections = append([]string{s}, append(sections[:i:i], sections[i+1:]...)...)
			break
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n", title)
	for _, s := range sections {
		fmt.Fprintf(&b, "\n## %s\n\n| figure | value | floor (same run) | ratio | target |\n|---|---:|---|---:|---|\n", s)
		for _, k := range rows[s] {
			f := last[k]
			floor, r := "", ""
			if f.FloorName != "" {
				floor = fmt.Sprintf("%s: %s", f.FloorName, format(f.Floor, f.Unit))
				r = fmt.Sprintf("%.2f×", ratio(f))
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", escape(f.Name), format(f.Value, f.Unit), escape(floor), r, escape(f.Target))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Percentile is the p-th percentile (0 to 100) of ds, the sample at index
// (n-1)·p/100 of the sorted samples, as every benchmark here has computed
// it: with 50 samples, p99 is the second largest. ds is not reordered; an
// empty ds has no percentile and gives 0.
func Percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

// Ms is d in milliseconds, the unit most figures are recorded in.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Us is d in microseconds.
func Us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

func ratio(f Figure) float64 {
	if f.Floor == 0 {
		return math.NaN()
	}
	return f.Value / f.Floor
}

// format prints three significant digits, enough to compare and not more
// than the run-to-run noise supports.
func format(v float64, unit string) string {
	s := fmt.Sprintf("%.3g", v)
	if strings.Contains(s, "e") {
		s = fmt.Sprintf("%.0f", v)
	}
	switch unit {
	case "", "count":
		return s
	case "×":
		return s + "×"
	}
	return s + " " + unit
}

func escape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// HeadlineSection is the report's first section: what a user of inpod
// pays per pod.
const HeadlineSection = "Pod start-up (create → Ready)"

// SchedulerSeesSection gathers, across gate modes, how long a readiness
// change takes to reach what the scheduler reads: the DRA gate's device
// taint, the taint controller's Node taint. (The device-plugin gate's
// window is the kubelet's node-status sync, up to 10 s, measured by e2e.)
const SchedulerSeesSection = "Readiness change visible to the scheduler, per gate mode"

// The sections of make bench-scale: what inpod costs the cluster's shared
// parts past one node, on a real control plane with simulated nodes, each
// figure beside the same run without inpod. One section a benchmark, so
// one run alone (benchreport -update) replaces only its own rows.
const (
	ScaleSchedulingSection = "Past one node: the scheduler and readiness flips, per gate (real scheduler, simulated nodes)"
	ScaleTaintSection      = "Past one node: the taint controller (simulated nodes)"
	ScaleAdmissionSection  = "Past one node: admission, per mode (pod creates at 100/s)"
	ScaleAgentSection      = "Past one node: the agent in a big cluster"
)

// Splice puts the sections of part (a report Render wrote, its title line
// dropped) into doc, a whole report: a section doc has is replaced, one it
// lacks goes before doc's closing "Measured by" paragraph, and every other
// section of doc stays as it was. So a benchmark run on its own (make
// bench-scale) updates its part of the report without losing the rest.
func Splice(doc, part string) string {
	for _, sec := range sections(part) {
		// The heading at the start of a line: "### X" is not "## X".
		head := sec[:strings.Index(sec, "\n")+1]
		if i := strings.Index(doc, "\n"+head); i >= 0 {
			i++
			end := len(doc)
			if j := strings.Index(doc[i+len(head):], "\n## "); j >= 0 {
				end = i + len(head) + j + 1
			} else if j := strings.LastIndex(doc, "\nMeasured by "); j > i {
				end = j + 1
			}
			doc = doc[:i] + sec + doc[end:]
			continue
		}
		if j := strings.LastIndex(doc, "\nMeasured by "); j >= 0 {
			doc = doc[:j+1] + sec + doc[j+1:]
		} else {
			doc = strings.TrimRight(doc, "\n") + "\n\n" + sec
		}
	}
	return doc
}

// sections splits a report into its "## " sections, each ending in a blank
// line.
func sections(report string) []string {
	var out []string
	parts := strings.Split("\n"+report, "\n## ")
	for _, p := range parts[1:] {
		out = append(out, "## "+strings.TrimRight(p, "\n")+"\n\n")
	}
	return out
}
