package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/inpod-dev/inpod/deviceplugin"
	"github.com/inpod-dev/inpod/readiness"
)

// Gate makes scheduling onto this node follow readiness (deviceplugin
// today; DRA and the Node condition next). The agent runs every configured
// gate alongside its other pieces: Run follows ready until ctx ends, and
// its error stops the agent.
type Gate interface {
	// Name is the gate's --gate value.
	Name() string
	Run(ctx context.Context, ready *readiness.Aggregate) error
}

// gateNames are the --gate values the agent can build; "none" is the empty
// list.
var gateNames = []string{"deviceplugin"}

// laterGates are named by the design but not built yet.
var laterGates = []string{"dra", "node-condition"}

// newGates builds the gates of a --gate list, before anything runs: an
// unknown name fails New. A new gate is one case here.
func (a *Agent) newGates(list string) ([]Gate, error) {
	if strings.TrimSpace(list) == "" {
		list = "deviceplugin"
	}
	var gates []Gate
	var names []string
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if slices.Contains(names, name) {
			return nil, fmt.Errorf("agent: --gate %q names %q twice", list, name)
		}
		names = append(names, name)
		switch {
		case name == "none":
			continue
		case name == "deviceplugin":
			cfg := a.cfg.DevicePlugin
			cfg.Observer, cfg.Logger, cfg.DevicesFrom = a.Metrics, a.log, a.podCapacity
			dp, err := deviceplugin.New(cfg)
			if err != nil {
				return nil, err
			}
			gates = append(gates, dp)
		case slices.Contains(laterGates, name):
			return nil, fmt.Errorf("agent: gate %q is not available in this version (want %s, or none)", name, strings.Join(gateNames, ", "))
		default:
			return nil, fmt.Errorf("agent: unknown gate %q (want %s, or none)", name, strings.Join(gateNames, ", "))
		}
	}
	if slices.Contains(names, "none") && len(names) > 1 {
		return nil, fmt.Errorf("agent: --gate %q: none cannot be combined with a gate", list)
	}
	return gates, nil
}
