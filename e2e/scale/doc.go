// Package scale measures what inpod costs a cluster's shared parts past one
// node (make bench-scale): the real etcd, kube-apiserver and kube-scheduler
// with simulated nodes, Node objects whose status the benchmark writes (no
// kubelets), and each gate's per-node objects as the agent (and for the
// device plugin, the kubelet) would publish them: the extended resource in
// allocatable, a ResourceSlice per node, or the Node condition with the
// real inpod-controller owning the startup taint. Every figure stands
// beside the same measurement without inpod in the same run.
//
// The benchmarks are in the integration build tag's test files; this
// package has no other code.
package scale
