#!/usr/bin/env bash
# Builds the pinned Kubernetes and etcd binaries the test node uses and caches
# them outside the repository, keyed by version: a warm call takes seconds, a
# cold one ~17 minutes on 2 cores (the Go build cache makes later cold builds
# of the same version fast too). Prints the bin directory on stdout.
#
# Usage: hack/k8s-bins.sh [kubectl]
# The control plane, the kubelet and etcd always; kubectl when asked for
# (the Makefile asks: two e2e tests and the person at the node use it).
# kube-proxy is not built: the node runs none.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${INPOD_CACHE_DIR:-/var/cache/inpod}
bindir=$cache/k8s-$K8S_VERSION-etcd-$ETCD_VERSION
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
for extra in "$@"; do
  case $extra in
    kubectl) k8s_cmds+=(kubectl) ;;
    *) echo "k8s-bins: unknown extra binary $extra (known: kubectl)" >&2; exit 2 ;;
  esac
done

missing=()
for b in "${k8s_cmds[@]}"; do [ -x "$bindir/$b" ] || missing+=("$b"); done
need_etcd=0
[ -x "$bindir/etcd" ] || need_etcd=1
if [ ${#missing[@]} -eq 0 ] && [ "$need_etcd" = 0 ]; then echo "$bindir"; exit 0; fi

mkdir -p "$bindir"
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# Each binary is written under a temporary name and renamed into place, so
# an interrupted build never leaves a binary that looks complete.
if [ ${#missing[@]} -gt 0 ]; then
  echo "building Kubernetes $K8S_VERSION (${missing[*]}) into $bindir (cold: ~17 min)" >&2
  (
    cd "$repo/tools/k8s"
    for b in "${missing[@]}"; do
      echo "  $b" >&2
      CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$bindir/.$b.tmp" "k8s.io/kubernetes/cmd/$b"
      mv "$bindir/.$b.tmp" "$bindir/$b"
    done
  )
fi
if [ "$need_etcd" = 1 ]; then
  echo "  etcd $ETCD_VERSION" >&2
  (cd "$repo/tools/etcd" && CGO_ENABLED=0 go build -trimpath -o "$bindir/.etcd.tmp" . && mv "$bindir/.etcd.tmp" "$bindir/etcd")
fi
echo "$bindir"
