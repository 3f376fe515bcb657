package enroll

import (
	"context"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/inpod-dev/inpod/cnievent"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/zds"
)

// The enrolled-pod table (enrolled and held pods, under p.mu): its
// accessors and queries, the look-up of the pod a CNI request names, and
// the marks of ended sandboxes (relabelled out while draining, DEL seen).

func (p *Pipeline) entry(uid types.UID) *entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.enrolled[uid]
}

// setEntry puts e in the table, or takes the pod out when e is nil.
func (p *Pipeline) setEntry(uid types.UID, e *entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e == nil {
		delete(p.enrolled, uid)
		return
	}
	p.enrolled[uid] = e
}

func (p *Pipeline) heldPod(uid types.UID) *heldPod {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[uid]
}

// setHeld holds the pod, or releases it when h is nil.
func (p *Pipeline) setHeld(uid types.UID, h *heldPod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if h == nil {
		delete(p.held, uid)
		return
	}
	p.held[uid] = h
}

// IsEnrolled reports whether the pod is in the table.
func (p *Pipeline) IsEnrolled(uid types.UID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.enrolled[uid]
	return ok
}

// Snapshot lists every enrolled pod with its netns, for a ztunnel that
// (re)connects, and every held pod without one (sent as Keep). Each netns is a duplicate the server owns and closes once
// sent: taken under p.mu, where no entry's file is closed, it survives an
// unenroll or a re-enrollment that closes the table's file while the
// snapshot is on its way.
func (p *Pipeline) Snapshot(context.Context) ([]zds.Workload, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]zds.Workload, 0, len(p.enrolled))
	for _, e := range p.enrolled {
		w, err := e.info.Dup()
		if err != nil {
			// A snapshot without this pod would let ztunnel drop its
			// proxy, and readiness would claim it knows every pod.
			for _, o := range out {
				o.NetNS.Close()
			}
			return nil, fmt.Errorf("snapshot pod %s: %w", e.pod, err)
		}
		out = append(out, w)
	}
	for uid, h := range p.held {
		// While its enrollment is under way the pod is in both; the
		// Add speaks for it.
		if _, ok := p.enrolled[uid]; !ok {
			out = append(out, h.info)
		}
	}
	return out, nil
}

// PruneSafe reports whether EnrolledIPs names every IP a pod of the mesh
// may have: not while a held pod reports no IPs yet (the previous agent
// exempted the IPs its ADD named, which nothing here knows).
func (p *Pipeline) PruneSafe() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid, h := range p.held {
		if _, ok := p.enrolled[uid]; !ok && len(h.ips) == 0 {
			return false
		}
	}
	return true
}

// ipsOfOthers lists the IPs of every enrolled or held pod but uid.
func (p *Pipeline) ipsOfOthers(uid types.UID) []netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.Addr
	for u, e := range p.enrolled {
		if u != uid {
			out = append(out, e.ips...)
		}
	}
	for u, h := range p.held {
		if u != uid {
			out = append(out, h.ips...)
		}
	}
	return out
}

// EnrolledIPs lists every enrolled or held pod's IPs, for pruning the probe
// set: a held pod's rules still send its probes through ztunnel.
func (p *Pipeline) EnrolledIPs() []netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.Addr
	for _, e := range p.enrolled {
		out = append(out, e.ips...)
	}
	for _, h := range p.held {
		out = append(out, h.ips...)
	}
	return out
}

// UIDsOf lists the enrolled and held pods of a name: more than one when a pod was
// deleted and recreated under its name (a StatefulSet's) and the old one's
// removal was missed.
func (p *Pipeline) UIDsOf(pod types.NamespacedName) []types.UID {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []types.UID
	for uid, e := range p.enrolled {
		if e.pod == pod {
			out = append(out, uid)
		}
	}
	for uid, h := range p.held {
		if h.pod == pod {
			out = append(out, uid)
		}
	}
	return out
}

// Enrolled lists the enrolled and held pods by name, for the periodic
// sandbox check.
func (p *Pipeline) Enrolled() []types.NamespacedName {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]types.NamespacedName, 0, len(p.enrolled)+len(p.held))
	for _, e := range p.enrolled {
		out = append(out, e.pod)
	}
	// A held pod is retried by the same check until it is restored or
	// gone.
	for _, h := range p.held {
		out = append(out, h.pod)
	}
	return out
}

// lookup finds the enrolled pod a CNI request names: by the runtime's pod
// UID when it sent one, else by name.
func (p *Pipeline) lookup(req *cnievent.Request) (types.UID, bool) {
	if req.PodUID == "" {
		return p.sandboxNamed(req)
	}
	uid := types.UID(req.PodUID)
	if p.IsEnrolled(uid) {
		return uid, true
	}
	// A static pod: the runtime names it by its sandbox UID, the table by
	// its mirror's API UID.
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid, e := range p.enrolled {
		if e.sandboxUID == req.PodUID && e.pod.Namespace == req.PodNamespace && e.pod.Name == req.PodName {
			return uid, true
		}
	}
	return "", false
}

// sandboxNamed finds the enrolled pod of a request without a pod UID: of
// the pods enrolled under that name (a replaced pod and its replacement,
// while the watch lags), the one whose sandbox the request names, else any
// (the caller then checks the sandbox itself).
func (p *Pipeline) sandboxNamed(req *cnievent.Request) (types.UID, bool) {
	key := types.NamespacedName{Namespace: req.PodNamespace, Name: req.PodName}
	type candidate struct {
		uid types.UID
		e   *entry
	}
	var named []candidate
	p.mu.Lock()
	for uid, e := range p.enrolled {
		if e.pod == key {
			named = append(named, candidate{uid, e})
		}
	}
	p.mu.Unlock()
	if len(named) == 0 {
		return "", false
	}
	// Outside the table's lock: telling the sandbox may stat its netns.
	for _, c := range named {
		if c.e.names(req) {
			return c.uid, true
		}
	}
	return named[0].uid, true
}

// names reports whether req is about the sandbox e holds.
func (e *entry) names(req *cnievent.Request) bool {
	if e.containerID != "" {
		return req.ContainerID == e.containerID
	}
	return e.holds(req.Netns)
}

// holds reports whether path resolves to the held netns.
func (e *entry) holds(path string) bool {
	if path == "" {
		return false
	}
	id, err := netns.IdentityOfPath(path)
	return err == nil && id == e.id
}

// markRelabelledOut remembers a terminating pod a label change took out
// of the mesh, unless its sandbox's DEL has come.
func (p *Pipeline) markRelabelledOut(pod *corev1.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, gone := p.delSeen[pod.UID]; gone {
		return
	}
	if _, gone := p.delSeen[types.UID(SandboxUID(pod))]; gone {
		return
	}
	p.relabelledOut[pod.UID] = types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name}
}

// mayRedirectAgain: a terminating pod not in the table still runs a
// sandbox to redirect (it was relabelled out while draining, and no DEL
// came since).
func (p *Pipeline) mayRedirectAgain(pod *corev1.Pod) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, out := p.relabelledOut[pod.UID]
	_, del := p.delSeen[pod.UID]
	_, sandboxDel := p.delSeen[types.UID(SandboxUID(pod))]
	return out && !del && !sandboxDel
}

func (p *Pipeline) sawDel(uid types.UID, pod types.NamespacedName) {
	if uid == "" {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delSeen[uid] = pod
}

// forgetEnded drops the marks of a pod enrolled again: a DEL seen before
// was an older sandbox's.
func (p *Pipeline) forgetEnded(pod *corev1.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.relabelledOut, pod.UID)
	delete(p.delSeen, pod.UID)
	delete(p.delSeen, types.UID(SandboxUID(pod)))
}

// ForgetGone drops what the pipeline remembers of incarnations of the pod
// named key other than live (zero: the pod is gone from the API).
func (p *Pipeline) ForgetGone(key types.NamespacedName, live types.UID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range []map[types.UID]types.NamespacedName{p.relabelledOut, p.delSeen} {
		for uid, pod := range m {
			if pod == key && uid != live {
				delete(m, uid)
			}
		}
	}
}
