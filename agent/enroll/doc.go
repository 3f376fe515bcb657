// Package enroll carries each enrolled pod through its life: redirect it on
// the CNI event, hand its netns to ztunnel, follow label changes and
// deletion, re-prove it while it runs, and restore everything after an
// agent restart without touching running traffic. Who is enrolled is
// package enrollment's rule, shared with the webhook and the policies.
//
// The files follow the pod: pipeline.go the types and wiring, cni.go the
// CNI verbs, enroll.go enrolling a sandbox (and its rollback) and
// unenrolling, table.go the enrolled-pod table and what is asked of it,
// reconcile.go following the API (and the restart), verify.go and sweep.go
// the continuous proof (sweep.go: inpod's rules in pods outside the mesh),
// prestart.go whether a container may start (the device plugin asks),
// mirror.go static pods, annotations.go the pod's annotation.
package enroll
