// Package requestwebhook is inpod-controller's mutating admission webhook
// for automatic resource requests, for clusters whose Kubernetes lacks the
// admissionregistration.k8s.io/v1 MutatingAdmissionPolicy the chart uses
// otherwise: at a pod's creation, when the enrollment rules enroll it, one
// container (the first) gains `inpod.dev/redirection: 1` in its requests
// and limits, so the scheduler places the pod only on a node ready for
// redirection and users edit nothing. With Config.ReadinessGate it also
// adds the readiness gate inpod.dev/redirected to the same pods (the
// chart's enrollment.readinessGate), so a Service sends an enrolled pod
// traffic only once the agent has proven its redirection and set that
// condition True (package agent/podcondition); the pod's own readiness
// gates are kept. With Config.NoResourceRequest the request is left out
// (a gate that advertises no resource) and the webhook serves the
// readiness gate alone.
//
// # The safety argument
//
// The request is a scheduling hint, and the readiness gate a promise about
// traffic, not the guarantee. An enrolled pod never runs unredirected
// because inpod-cni fails its ADD on a node that is not ready, whatever the
// pod requests; so a pod that misses the request (the webhook down, a
// namespace not in the cache and the API unreachable) only waits on a node
// that is not ready, and is retried by the runtime; one that misses the
// readiness gate is Ready on its containers' word alone, as before. A
// pod outside the mesh must never be blocked, so the webhook never refuses a
// pod: every answer is allowed, with or without a patch, and the chart
// registers it with failurePolicy Ignore, so the API server admits pods
// unchanged while no replica answers (a webhook that failed closed would
// stop every pod creation in the cluster, the controller's own included,
// when the controller is down).
//
// The decision is the agent's (agent/enroll Policy.Enrolled), so the
// webhook adds the request exactly to the pods the agent will redirect: the
// pod's enrollment label wins (ambient enrolls, none opts out), else its
// namespace's; never hostNetwork pods or excluded namespaces. Beyond the
// agent's rules, as the MutatingAdmissionPolicy: never inpod's own pods
// (app.kubernetes.io/part-of=inpod: a request would make the agent wait
// for itself), and never a pod that already requests the resource in any
// container (a second request would ask a node for two), and the
// readiness gate only once. Wrong in the other direction, a request on a
// pod the agent does not enroll would keep a pod outside the mesh off nodes
// that are not ready, and a readiness gate on it would keep it out of its
// Services for good (no agent ever proves it): that is why the namespace
// label is read, from a watch of Namespaces (falling back to a read from
// the API for a namespace the watch has not seen yet), and why a namespace
// that cannot be read gives neither.
//
// # Serving
//
// Every replica serves (not only the leader of the taint controller), from
// a certificate and key in a directory (tls.crt, tls.key: a
// kubernetes.io/tls Secret, cert-manager's or one's own, mounted there).
// The files are read again when they change, so a rotated certificate is
// served without a restart. The webhook starts without them (handshakes
// fail until they appear) and Run never fails, retrying its listener: it
// shares inpod-controller's process with the taint controller, which a
// webhook problem must never stop.
package requestwebhook
