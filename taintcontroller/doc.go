// Package taintcontroller is inpod-controller's taint mode: it removes the
// node's startup taint (default inpod.dev/not-ready:NoSchedule) once the
// node is ready for redirection, and in continuous mode puts it back while
// the node is not.
//
// # The safety argument
//
// A node is judged ready only on two independent pieces of positive
// evidence, both read from synced watches: the Node condition
// InPodRedirectionReady is True (the agent's own readiness aggregate: CNI
// plugin chained, ztunnel connected, pods synced) AND one of the node's
// agent pods is Ready and not terminating (the kubelet's view that the
// agent process is alive and answers its readiness probe). The condition
// alone is not enough: a dead agent cannot write False, so a stale True
// must be cancelled by the kubelet's view of the agent pod. Anything else —
// no condition, Unknown, False, no agent pod, a pod not Ready — keeps the
// taint.
//
// Removing the taint is the only step that can let an enrolled pod reach
// the node, and it happens only on that evidence. Between the agent's death
// and the kubelet noticing (its PLEG relist, about a second; or, when the
// whole node dies, the node lifecycle controller's grace period, which then
// taints the node itself), the taint may be absent although the agent is
// gone; an enrolled pod scheduled in that window still cannot run
// unredirected, because the inpod-cni plugin fails its ADD while the agent
// is down (the CNI path is the guarantee; the taint only keeps pods from
// being scheduled onto a node where they would wait).
//
// The taint blocks every pod without a toleration, also pods outside the
// mesh. The controller therefore keeps the tainted window minimal: it
// reacts to watch events (no polling), removes the taint in one write, and
// in continuous mode re-taints only on an explicit False, or after a grace
// period for a missing or not-Ready agent pod (an agent rollout shorter than
// the grace period does not block anything). DaemonSets and other pods
// that must run on a not-ready node tolerate the taint.
//
// # Writes
//
// The controller edits only taints with its key and effect (and, in
// bootstrap mode, its own annotation), and removes the previous taints it
// is given (Config.PreviousTaints: the taint of an earlier configuration,
// which nothing else would ever remove) in the same write and on the same
// evidence as its own; it never adds them. Every write is a JSON merge patch
// carrying the resourceVersion it was computed from, so the API server
// refuses it (409 Conflict) when anyone changed the Node in between; the
// controller then reads the Node afresh and decides again. A concurrent
// change to another taint is never overwritten. Nodes outside the node
// selector are not even watched, so they are never written.
//
// # Modes
//
// bootstrap removes the taint once per Node object and records that in the
// annotation inpod.dev/startup-taint-removed on the Node itself, with the
// time and the taint it was for, so a controller restart or a leader change
// neither re-opens a finished node (the annotation names the taint: the
// node is left alone for good) nor skips an unfinished one (no annotation:
// the node is judged afresh). A node is done only for the taint its
// annotation names: one carrying another of the controller's taints (the
// annotation written for an earlier key, by the old leader of a rolling
// update that changed the key while the node-taint policy already added the
// new one, or by an older version that wrote the time alone) is judged
// again, and that taint removed on the same evidence. A Node deleted and
// created again with the same name is a new object without the annotation,
// and is bootstrapped again.
//
// continuous also adds the taint while the condition is False, or while the
// node is not ready for another reason for longer than the grace period.
// Adding needs evidence that the node is in the mesh, since the taint blocks
// pods outside it too: a node that never reported the condition is never
// tainted, and no node is while no agent pod (not terminating) exists
// anywhere — the agent DaemonSet being deleted is an uninstall, not every
// node failing at once.
// The grace timer is held in memory: after a restart or a leader change it
// starts again, which delays a re-taint by at most one grace period and
// never removes a taint early.
//
// # Leader election
//
// Replicas elect a leader on a Lease; only the leader runs the informers
// and writes. Its writes are made with a context that ends when it stops
// leading, and Run waits for the workers before it returns, so a former
// leader starts no write after it has stopped. A write already on the wire
// when leadership ends may still land; like every write it is conditional
// on the resourceVersion it was decided on, so it cannot overwrite what the
// new leader wrote after it (the new leader's own write would meet a
// Conflict, read afresh and decide again). Run returns an error when
// leadership is lost while its context is live: the process exits and
// restarts as a candidate.
package taintcontroller
