#!/usr/bin/env bash
# Prints a directory holding Debian's iptables tools and the libraries they
# need for another architecture (arm64 on an amd64 machine): the packages'
# files unpacked (dpkg-deb -x, nothing installed or run), for the agent
# image of that platform (release.Agent). The packages come from the
# Debian release of this machine through a private apt state of its own, so
# the machine's apt configuration and package list are left as they are.
# The iptables packages are pinned to the version installed here, so both
# platforms of an agent image carry the same iptables. Cached outside the
# repository, keyed by architecture and version; a second run prints the
# directory at once.
#
# usage: hack/debian-root.sh <debian-arch>     (arm64, amd64)
set -euo pipefail

arch=${1:?usage: $0 <debian-arch, e.g. arm64>}
cache=${INPOD_CACHE_DIR:-/var/cache/inpod}
# The iptables tools and what they link (apt-cache depends iptables); the
# image builder (release.RootFiles) fails naming any library missing here.
pkgs=(iptables libip4tc2 libip6tc2 libxtables12 libmnl0 libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libc6 libgcc-s1)
pinned=" iptables libip4tc2 libip6tc2 libxtables12 "

version=$(dpkg-query -W -f '${Version}' iptables 2>/dev/null) ||
  { echo "$0: iptables is not installed here (apt-get install iptables): the other platforms take its version" >&2; exit 1; }
dir=$cache/debian-$arch-iptables-$version
if [ -f "$dir/complete" ]; then echo "$dir"; exit 0; fi
command -v apt-get >/dev/null || { echo "$0: needs apt-get (a Debian machine)" >&2; exit 1; }
. /etc/os-release
[ -n "${VERSION_CODENAME:-}" ] || { echo "$0: no VERSION_CODENAME in /etc/os-release" >&2; exit 1; }

echo "fetching Debian $VERSION_CODENAME $arch packages for the agent image into $dir" >&2
rm -rf "$dir.tmp"
mkdir -p "$dir.tmp/apt/lists/partial" "$dir.tmp/apt/cache/archives/partial" "$dir.tmp/debs" "$dir.tmp/root"
: >"$dir.tmp/apt/status"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
{
  for suite in "$VERSION_CODENAME" "$VERSION_CODENAME-updates"; do
    echo "deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian $suite main"
  done
  echo "deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian-security $VERSION_CODENAME-security main"
} >"$dir.tmp/apt/sources.list"
apt=(apt-get -qq
  -o "Dir::Etc::SourceList=$dir.tmp/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State=$dir.tmp/apt" -o "Dir::State::status=$dir.tmp/apt/status" -o "Dir::Cache=$dir.tmp/apt/cache"
  -o "APT::Architecture=$arch" -o "APT::Architectures::=$arch" -o Debug::NoLocking=1
  -o APT::Sandbox::User=root)
"${apt[@]}" update
want=()
for p in "${pkgs[@]}"; do
  if [[ $pinned == *" $p "* ]]; then want+=("$p=$version"); else want+=("$p"); fi
done
(cd "$dir.tmp/debs" && "${apt[@]}" download "${want[@]}")
for deb in "$dir.tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$dir.tmp/root"; done
echo "$version" >"$dir.tmp/iptables.version"
rm -rf "$dir.tmp/apt"
touch "$dir.tmp/complete"
rm -rf "$dir"; mv "$dir.tmp" "$dir"
echo "$dir"
