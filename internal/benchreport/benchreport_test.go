package benchreport

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRecordAppendsAndRenderOrdersHeadlineFirst(t *testing.T) {
	path := filepath.Join(t.TempDir(), "figures.jsonl")
	t.Setenv(EnvFile, path)
	Record(t, Figure{Section: "ZDS", Name: "Add→Ack p50", Value: 0.512, Unit: "ms", FloorName: "bare round trip", Floor: 0.128})
	Record(t, Figure{Section: HeadlineSection, Name: "enrolled p50", Value: 1234, Unit: "ms", Target: "≤ 1.1× or +50 ms"})
	Record(t, Figure{Section: "ZDS", Name: "Add→Ack p50", Value: 0.256, Unit: "ms", FloorName: "bare round trip", Floor: 0.128})

	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	figures, err := Read(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	if len(figures) != 3 || figures[0].Source != t.Name() {
		t.Fatalf("read %d figures (%+v), want 3 with their source", len(figures), figures)
	}
	var out bytes.Buffer
	if err := Render(&out, "report", HeadlineSection, figures); err != nil {
		t.Fatal(err)
	}
	md := out.String()
	if strings.Index(md, HeadlineSection) > strings.Index(md, "## ZDS") {
		t.Errorf("headline not first:\n%s", md)
	}
	if !strings.Contains(md, "| Add→Ack p50 | 0.256 ms | bare round trip: 0.128 ms | 2.00× |") || strings.Contains(md, "0.512") {
		t.Errorf("a figure recorded twice should keep its last value with its ratio:\n%s", md)
	}
	if !strings.Contains(md, "| enrolled p50 | 1234 ms |  |  | ≤ 1.1× or +50 ms |") {
		t.Errorf("figure without a floor:\n%s", md)
	}
}

func TestReadRefusesATruncatedLine(t *testing.T) {
	_, err := Read(strings.NewReader(`{"section":"a","name":"b","value":1}` + "\n" + `{"section":"a","na`))
	if err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("got %v, want an error naming line 2", err)
	}
}

func TestPercentileIsTheNearestRankBelowAndLeavesItsInputAlone(t *testing.T) {
	var ds []time.Duration
	for i := 50; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	for _, c := range []struct {
		p    int
		want time.Duration
	}{{0, time.Millisecond}, {50, 25 * time.Millisecond}, {99, 49 * time.Millisecond}, {100, 50 * time.Millisecond}} {
		if got := Percentile(ds, c.p); got != c.want {
			t.Errorf("p%d of 1..50 ms = %s, want %s", c.p, got, c.want)
		}
	}
	if ds[0] != 50*time.Millisecond {
		t.Error("Percentile sorted its caller's slice")
	}
	if got := Percentile(nil, 50); got != 0 {
		t.Errorf("p50 of nothing = %s, want 0", got)
	}
	if got := Ms(1500 * time.Microsecond); got != 1.5 {
		t.Errorf("Ms(1.5ms) = %v", got)
	}
	if got := Us(1500 * time.Nanosecond); got != 1.5 {
		t.Errorf("Us(1.5µs) = %v", got)
	}
}

// TestSpliceReplacesItsSectionsAndKeepsTheRest: a section the report has
// is replaced in place (also the last one, before the closing paragraph),
// a new one goes before that paragraph, the others stay byte for byte.
func TestSpliceReplacesItsSectionsAndKeepsTheRest(t *testing.T) {
	doc := "# inpod benchmarks\n\n## A\n\n| a | 1 |\n\n## B\n\n| b | 1 |\n\nMeasured by `make bench` on h.\n"
	got := Splice(doc, "## B\n\n| b | 2 |\n\n_B again._\n\n## C\n\n| c | 1 |\n")
	want := "# inpod benchmarks\n\n## A\n\n| a | 1 |\n\n## B\n\n| b | 2 |\n\n_B again._\n\n## C\n\n| c | 1 |\n\nMeasured by `make bench` on h.\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	// A deeper heading of the same name is not the section.
	deeper := strings.Replace(want, "## A\n", "### A\n\n## A\n", 1)
	if got := Splice(deeper, "## A\n\n| a | 3 |\n"); !strings.Contains(got, "### A\n\n## A\n\n| a | 3 |") {
		t.Errorf("a ### heading taken for the ## section:\n%s", got)
	}
	got = Splice(want, "## A\n\n| a | 3 |\n")
	want = strings.Replace(want, "| a | 1 |", "| a | 3 |", 1)
	if got != want {
		t.Errorf("replacing the first section: got\n%s\nwant\n%s", got, want)
	}
}
