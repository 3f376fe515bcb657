package scale

import (
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// histogram is one Prometheus histogram from a text exposition, its
// buckets summed over the label sets that match.
type histogram struct {
	bounds []float64
	counts []float64 // cumulative, per bound
}

var (
	bucketLine = regexp.MustCompile(`^(\w+)_bucket\{(.*)\} (\S+)$`)
	// le as a label of its own: "profile" ends in "le" too.
	leLabel = regexp.MustCompile(`(?:^|,)le="([^"]+)"`)
)

// parseHistogram sums the buckets of name whose labels contain every one
// of match (`result="scheduled"`).
func parseHistogram(text, name string, match ...string) histogram {
	sums := map[float64]float64{}
	for _, line := range strings.Split(text, "\n") {
		m := bucketLine.FindStringSubmatch(line)
		if m == nil || m[1] != name {
			continue
		}
		if slices.ContainsFunc(match, func(s string) bool { return !strings.Contains(m[2], s) }) {
			continue
		}
		le := leLabel.FindStringSubmatch(m[2])
		if le == nil {
			continue
		}
		bound, err := strconv.ParseFloat(le[1], 64)
		if err != nil {
			bound = math.Inf(1)
		}
		v, _ := strconv.ParseFloat(m[3], 64)
		sums[bound] += v
	}
	var h histogram
	for bnd := range sums {
		h.bounds = append(h.bounds, bnd)
	}
	slices.Sort(h.bounds)
	for _, bnd := range h.bounds {
		h.counts = append(h.counts, sums[bnd])
	}
	return h
}

var sumCountLine = regexp.MustCompile(`^(\w+)_(sum|count)(?:\{(.*)\})? (\S+)$`)

// parseMean is the exact mean of name's observations (its _sum over its
// _count), over the label sets that contain every one of match: unlike a
// quantile, not bound to the buckets.
func parseMean(text, name string, match ...string) time.Duration {
	var sum, count float64
	for _, line := range strings.Split(text, "\n") {
		m := sumCountLine.FindStringSubmatch(line)
		if m == nil || m[1] != name || slices.ContainsFunc(match, func(s string) bool { return !strings.Contains(m[3], s) }) {
			continue
		}
		v, _ := strconv.ParseFloat(m[4], 64)
		if m[2] == "sum" {
			sum += v
		} else {
			count += v
		}
	}
	if count == 0 {
		return 0
	}
	return time.Duration(sum / count * float64(time.Second))
}

// sub is h minus an earlier scrape of the same histogram.
func (h histogram) sub(earlier histogram) histogram {
	out := histogram{bounds: h.bounds, counts: slices.Clone(h.counts)}
	for i, bnd := range h.bounds {
		if j := slices.Index(earlier.bounds, bnd); j >= 0 {
			out.counts[i] -= earlier.counts[j]
		}
	}
	return out
}

func (h histogram) count() float64 {
	if len(h.counts) == 0 {
		return 0
	}
	return h.counts[len(h.counts)-1]
}

// quantile interpolates linearly inside the bucket, as PromQL's
// histogram_quantile does.
func (h histogram) quantile(q float64) time.Duration {
	total := h.count()
	if total == 0 {
		return 0
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for i, bnd := range h.bounds {
		if h.counts[i] >= rank {
			if math.IsInf(bnd, 1) {
				return time.Duration(lower * float64(time.Second))
			}
			frac := (rank - below) / max(h.counts[i]-below, 1e-9)
			return time.Duration((lower + (bnd-lower)*frac) * float64(time.Second))
		}
		lower, below = bnd, h.counts[i]
	}
	return time.Duration(lower * float64(time.Second))
}

// TestHistogramFromSchedulerMetrics reads a histogram as kube-scheduler
// v1.37 exposes it (le after the other labels, one of which, "profile",
// ends in "le") and interpolates its quantiles as PromQL does.
func TestHistogramFromSchedulerMetrics(t *testing.T) {
	const text = `# TYPE scheduler_scheduling_attempt_duration_seconds histogram
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.001"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.002"} 50
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.004"} 100
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="+Inf"} 100
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="unschedulable",le="0.001"} 7
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="unschedulable",le="0.002"} 7
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="unschedulable",le="0.004"} 7
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="unschedulable",le="+Inf"} 7
scheduler_scheduling_attempt_duration_seconds_sum{profile="default-scheduler",result="scheduled"} 0.2
`
	h := parseHistogram(text, "scheduler_scheduling_attempt_duration_seconds", `result="scheduled"`)
	if h.count() != 100 {
		t.Fatalf("count %v, want 100 (the unschedulable attempts left out): %+v", h.count(), h)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 2 * time.Millisecond}, {0.25, 1500 * time.Microsecond}, {0.99, 3960 * time.Microsecond}} {
		if got := h.quantile(c.q); got.Round(time.Microsecond) != c.want {
			t.Errorf("quantile(%v) = %s, want %s", c.q, got, c.want)
		}
	}
	if m := parseMean(text+`scheduler_scheduling_attempt_duration_seconds_count{profile="default-scheduler",result="scheduled"} 100
`, "scheduler_scheduling_attempt_duration_seconds", `result="scheduled"`); m != 2*time.Millisecond {
		t.Errorf("mean %s, want 2ms (0.2 s over 100)", m)
	}
	earlier := parseHistogram(strings.ReplaceAll(text, "} 100", "} 60"), "scheduler_scheduling_attempt_duration_seconds", `result="scheduled"`)
	if d := h.sub(earlier); d.count() != 40 {
		t.Errorf("after an earlier scrape of 60: count %v, want 40", d.count())
	}
}
