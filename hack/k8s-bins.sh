#!/usr/bin/env bash
# Builds the pinned Kubernetes and etcd binaries the test node uses and caches
# them outside the repository, keyed by version: a warm call takes seconds, a
# cold one ~17 minutes on 2 cores (the Go build cache makes later cold builds
# of the same version fast too). Prints the bin directory on stdout.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${INPOD_CACHE_DIR:-/var/cache/inpod}
bindir=$cache/k8s-$K8S_VERSION-etcd-$ETCD_VERSION
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy)

complete=1
for b in "${k8s_cmds[@]}" etcd; do [ -x "$bindir/$b" ] || complete=0; done
if [ "$complete" = 1 ]; then echo "$bindir"; exit 0; fi

mkdir -p "$bindir.tmp"
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

echo "building Kubernetes $K8S_VERSION into $bindir (cold: ~17 min)" >&2
(
  cd "$repo/tools/k8s"
  for b in "${k8s_cmds[@]}"; do
    echo "  $b" >&2
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$bindir.tmp/$b" "k8s.io/kubernetes/cmd/$b"
  done
)
echo "  etcd $ETCD_VERSION" >&2
(cd "$repo/tools/etcd" && CGO_ENABLED=0 go build -trimpath -o "$bindir.tmp/etcd" .)

rm -rf "$bindir"
mv "$bindir.tmp" "$bindir"
echo "$bindir"
