#!/usr/bin/env bash
# Builds the reference CNI plugins (bridge, host-local, loopback, portmap)
# and cnitool at pinned versions into a cache outside the repository, keyed
# by version; seconds when cached. Prints the bin directory on stdout.
set -euo pipefail

PLUGINS_VERSION=v1.10.0
CNI_VERSION=v1.3.1
cache=${INPOD_CACHE_DIR:-/var/cache/inpod}
bindir=$cache/cni-plugins-$PLUGINS_VERSION-cni-$CNI_VERSION
plugins=(main/bridge ipam/host-local main/loopback meta/portmap)

complete=1
for p in "${plugins[@]}" cnitool; do [ -x "$bindir/$(basename "$p")" ] || complete=0; done
if [ "$complete" = 1 ]; then echo "$bindir"; exit 0; fi

echo "building CNI plugins $PLUGINS_VERSION and cnitool $CNI_VERSION into $bindir" >&2
rm -rf "$bindir.tmp"; mkdir -p "$bindir.tmp"
for p in "${plugins[@]}"; do
  CGO_ENABLED=0 GOBIN="$bindir.tmp" go install -trimpath "github.com/containernetworking/plugins/plugins/$p@$PLUGINS_VERSION"
done
CGO_ENABLED=0 GOBIN="$bindir.tmp" go install -trimpath "github.com/containernetworking/cni/cnitool@$CNI_VERSION"
rm -rf "$bindir"; mv "$bindir.tmp" "$bindir"
echo "$bindir"
