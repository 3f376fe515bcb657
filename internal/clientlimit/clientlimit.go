// Package clientlimit resolves the API client rate limit that inpod's
// binaries take as --kube-api-qps and --kube-api-burst. client-go takes
// any pair silently, but a NaN, infinite or non-positive rate, or a burst
// below the rate, would leave the client unable to reach its rate or
// unable to send at all; a binary refuses them at start instead.
package clientlimit

import (
	"fmt"
	"math"
)

// Resolve checks a rate (requests a second) and a burst; an unset burst
// (0) is defaultBurst, or the rate if higher, so raising the rate alone
// works.
func Resolve(qps float64, burst, defaultBurst int) (float32, int, error) {
	if !(qps > 0) || math.IsInf(qps, 1) || burst < 0 { // NaN too
		return 0, 0, fmt.Errorf("--kube-api-qps %v or --kube-api-burst %d is not a usable rate limit: want a rate above 0 and a burst of at least 0", qps, burst)
	}
	if burst == 0 {
		burst = max(defaultBurst, int(math.Ceil(qps)))
	}
	if float64(burst) < qps {
		return 0, 0, fmt.Errorf("--kube-api-burst %d is below --kube-api-qps %v: client-go would never reach the rate", burst, qps)
	}
	return float32(qps), burst, nil
}
