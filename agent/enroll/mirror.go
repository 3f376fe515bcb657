package enroll

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/inpod-dev/inpod/cnievent"
)

// Static pods (manifests the kubelet reads from its staticPodPath) are not
// API objects: the kubelet gives each the UID from its manifest or, usually,
// a hash of it, and creates a mirror pod in the API under the same namespace
// and name, with the manifest's labels, its own API UID, and that hash in
// the annotation MirrorAnnotation (kubelet v1.37: pkg/kubelet/pod
// mirror_client.go CreateMirrorPod; the hash is the static pod's
// kubernetes.io/config.hash, which pkg/kubelet/config applyDefaults sets to
// its UID). The runtime's K8S_POD_UID is the static pod's UID, so it equals
// the mirror's annotation, never the mirror's UID. ztunnel and the pod table
// keep the mirror's API UID, as Istio does.
const MirrorAnnotation = "kubernetes.io/config.mirror"

// SandboxUID is the UID the runtime knows the pod by: for a mirror pod the
// static pod's, otherwise the pod's own.
func SandboxUID(pod *corev1.Pod) string {
	if hash := pod.Annotations[MirrorAnnotation]; hash != "" {
		return hash
	}
	return string(pod.UID)
}

// sandboxOf reports whether a runtime's UID names this pod. A mirror pod's
// own UID is accepted as well: nothing else can hold it.
func sandboxOf(pod *corev1.Pod, runtimeUID string) bool {
	return runtimeUID == "" || runtimeUID == string(pod.UID) || runtimeUID == SandboxUID(pod)
}

// podNotInAPI answers an ADD for a pod that neither the cache nor the API
// has. That is not knowledge that the pod is outside the mesh: a static
// pod's mirror may not exist yet (the kubelet creates it asynchronously, and
// cannot while the API server is unreachable), and the manifest's labels,
// which may enroll it, are only known from the mirror. A static pod's UID is
// whatever its manifest says, so it cannot be told apart from a pod deleted
// meanwhile; failing costs nothing for the deleted one (its sandbox never
// runs), and for a static pod makes the kubelet retry until its mirror pod
// is there.
func podNotInAPI(req *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, fmt.Errorf("pod %s is not in the API server (a static pod whose mirror pod the kubelet has not created yet, or a pod deleted already), so whether it is enrolled is unknown; the runtime will retry", req.Pod())
}
