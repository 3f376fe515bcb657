package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/passlist"
)

// Plugin holds what the commands need from outside, so tests can run them
// in-process.
type Plugin struct {
	Stdout io.Writer
	// decideWithoutAgent is replaceable for fault injection.
	decideWithoutAgent func(conf *Config, k k8sArgs, cniPath string) (enrolled bool, why string, err error)
}

// New returns a plugin writing results to stdout.
func New() *Plugin { return &Plugin{Stdout: os.Stdout, decideWithoutAgent: decideFromAPI} }

// Funcs wires the plugin into skel.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

// Add asks the agent to redirect an enrolled pod and passes the previous
// result through unchanged.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	conf, prev, ips, err := parseChained(args.StdinData, "ADD")
	if err != nil {
		return err
	}
	k, err := parseK8sArgs(args.Args)
	if err != nil {
		return err
	}
	if err := p.handle(conf, k, cnievent.Add, args, ips); err != nil {
		return err
	}
	return p.passThrough(prev)
}

// Check asks the agent to verify an enrolled pod's redirection. With the
// agent unreachable there is nothing to verify against and CHECK passes.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	conf, _, ips, err := parseChained(args.StdinData, "CHECK")
	if err != nil {
		return err
	}
	k, err := parseK8sArgs(args.Args)
	if err != nil {
		return err
	}
	if k.Name == "" || conf.excluded(k.Namespace) {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), conf.timeout)
	defer cancel()
	resp, err := cnievent.Send(ctx, conf.AgentSocket, request(cnievent.Check, k, args, ips))
	if errors.Is(err, cnievent.ErrUnreachable) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inpod-cni: CHECK of pod %s/%s: %w", k.Namespace, k.Name, err)
	}
	if resp.Outcome == cnievent.Failed {
		return fmt.Errorf("inpod-cni: CHECK of pod %s/%s: redirection is not intact: %s", k.Namespace, k.Name, resp.Message)
	}
	return nil
}

// Del tells the agent, best effort: DEL never fails, since a failing DEL
// only makes the runtime retry forever for a pod that is gone anyway. The
// agent also notices deletions through its own pod watch.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	k, err := parseK8sArgs(args.Args)
	if err != nil || k.Name == "" || conf.excluded(k.Namespace) {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if resp, err := cnievent.Send(ctx, conf.AgentSocket, request(cnievent.Del, k, args, nil)); err != nil || resp.Outcome == cnievent.Failed {
		fmt.Fprintf(os.Stderr, "inpod-cni: DEL of pod %s/%s not confirmed by the agent (it cleans up on its own): %v\n", k.Namespace, k.Name, describe(resp, err))
	}
	return nil
}

// Status reports the plugin ready: it can always answer an ADD (it fails
// closed per enrolled pod when the agent is away), and reporting otherwise
// would make the runtime refuse every pod on the node, enrolled or not.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	_, err := ParseConfig(args.StdinData)
	return err
}

// GC has nothing to collect: the plugin keeps no state, and the agent
// reconciles its pods from its own pod watch.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	_, err := ParseConfig(args.StdinData)
	return err
}

func (p *Plugin) handle(conf *Config, k k8sArgs, cmd cnievent.Command, args *skel.CmdArgs, ips []string) error {
	if k.Name == "" || k.Namespace == "" || conf.excluded(k.Namespace) {
		// Not a Kubernetes pod, or one inpod never enrolls.
		return nil
	}
	if conf.PassList != "" && passlist.Passes(conf.PassList, k.Namespace, k.Name, k.UID) {
		// The live agent has already classified the pod as not enrolled.
		return nil
	}
	pod := k.Namespace + "/" + k.Name
	ctx, cancel := context.WithTimeout(context.Background(), conf.timeout)
	defer cancel()
	resp, err := cnievent.Send(ctx, conf.AgentSocket, request(cmd, k, args, ips))
	switch {
	case errors.Is(err, cnievent.ErrUnreachable):
		enrolled, why, derr := p.decideWithoutAgent(conf, k, args.Path)
		if derr != nil {
			return fmt.Errorf("inpod-cni: pod %s: %v, and enrollment could not be decided without it (%v); failing the ADD so an enrolled pod never runs unredirected, the runtime will retry", pod, err, derr)
		}
		if enrolled {
			return fmt.Errorf("inpod-cni: pod %s is enrolled in the mesh (%s) but %v; failing the ADD so it never runs unredirected, the runtime will retry", pod, why, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("inpod-cni: pod %s: %w", pod, err)
	case resp.Outcome == cnievent.Failed:
		return fmt.Errorf("inpod-cni: pod %s: redirection failed: %s", pod, resp.Message)
	}
	return nil
}

func request(cmd cnievent.Command, k k8sArgs, args *skel.CmdArgs, ips []string) *cnievent.Request {
	return &cnievent.Request{
		Command: cmd, PodNamespace: k.Namespace, PodName: k.Name, PodUID: k.UID,
		ContainerID: args.ContainerID, Netns: args.Netns, IfName: args.IfName, IPs: ips,
	}
}

func describe(resp *cnievent.Response, err error) string {
	if err != nil {
		return err.Error()
	}
	return resp.Message
}

// parseChained parses the configuration and the previous result, which a
// chained plugin cannot work without, and extracts the pod's IPs.
func parseChained(data []byte, cmd string) (*Config, []byte, []string, error) {
	conf, err := ParseConfig(data)
	if err != nil {
		return nil, nil, nil, err
	}
	if len(conf.PrevResult) == 0 {
		return nil, nil, nil, fmt.Errorf("inpod-cni: %s without field \"prevResult\": inpod-cni must be chained after the primary network plugin", cmd)
	}
	res, err := version.NewResult(conf.CNIVersion, conf.PrevResult)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("inpod-cni: field \"prevResult\" is not a valid %s result: %v", conf.CNIVersion, err)
	}
	cur, err := types100.NewResultFromResult(res)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("inpod-cni: field \"prevResult\": %v", err)
	}
	var ips []string
	for _, ip := range cur.IPs {
		// An entry without an address ("ips":[{}] parses) names no IP; sent
		// as "<nil>" the agent would refuse the request, and with it the
		// start of every pod, enrolled or not. Past the agent's bound the
		// rest are left out for the same reason (a pod has one IP per
		// family).
		if ip.Address.IP == nil || len(ips) == cnievent.MaxIPs {
			continue
		}
		ips = append(ips, ip.Address.IP.String())
	}
	return conf, conf.PrevResult, ips, nil
}

// passThrough writes the previous result exactly as received.
func (p *Plugin) passThrough(prev []byte) error {
	_, err := p.Stdout.Write(prev)
	return err
}
