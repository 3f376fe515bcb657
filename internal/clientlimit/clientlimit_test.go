package clientlimit

import (
	"math"
	"strings"
	"testing"
)

// A rate limit client-go cannot honour is refused, with the flag named; an
// unset burst follows a higher rate.
func TestResolve(t *testing.T) {
	for _, c := range []struct {
		qps       float64
		burst     int
		wantQPS   float32
		wantBurst int
		wantErr   string
	}{
		{100, 0, 100, 200, ""},
		{100, 200, 100, 200, ""},
		{500, 0, 500, 500, ""},
		{2.5, 3, 2.5, 3, ""},
		{500, 200, 0, 0, "below --kube-api-qps"},
		{0, 0, 0, 0, "not a usable rate limit"},
		{-1, 0, 0, 0, "not a usable rate limit"},
		{math.NaN(), 0, 0, 0, "not a usable rate limit"},
		{math.Inf(1), 0, 0, 0, "not a usable rate limit"},
		{100, -1, 0, 0, "not a usable rate limit"},
	} {
		qps, burst, err := Resolve(c.qps, c.burst, 200)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("qps %v burst %d: error %v, want one containing %q", c.qps, c.burst, err, c.wantErr)
			}
			continue
		}
		if err != nil || qps != c.wantQPS || burst != c.wantBurst {
			t.Errorf("qps %v burst %d: got %v, %d, %v; want %v, %d", c.qps, c.burst, qps, burst, err, c.wantQPS, c.wantBurst)
		}
	}
}
