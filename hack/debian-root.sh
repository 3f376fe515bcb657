#!/usr/bin/env bash
# Prints a directory holding Debian's iptables tools and the libraries they
# need for another architecture (arm64 on an amd64 machine): the packages'
# files unpacked under root/ (dpkg-deb -x, nothing installed or run), for
# the agent image of that platform (release.Agent). The packages come from
# the Debian release of this machine through a private apt state of its
# own, so the machine's apt configuration and package list are left as they
# are. Every package is pinned to the version installed here, so both
# platforms of an agent image carry the same iptables and libraries, and
# the cache (outside the repository) is keyed by the architecture and those
# versions: an upgrade here fetches again. A second run prints the
# directory at once.
#
# Needs a Debian machine (its release's suites on deb.debian.org; Ubuntu's
# are not there), root or INPOD_CACHE_DIR, and access to deb.debian.org.
#
# usage: hack/debian-root.sh <debian-arch>     (arm64, amd64)
set -euo pipefail

arch=${1:?usage: $0 <debian-arch, e.g. arm64>}
cache=${INPOD_CACHE_DIR:-/var/cache/inpod}
# The iptables tools and what they link (apt-cache depends iptables); the
# image builder (release.RootFiles) fails naming any library missing here.
pkgs=(iptables libip4tc2 libip6tc2 libxtables12 libmnl0 libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libc6 libgcc-s1)

. /etc/os-release
if [ "${ID:-}" != debian ] || [ -z "${VERSION_CODENAME:-}" ]; then
  echo "$0: needs a Debian machine (this is ${PRETTY_NAME:-unknown}): the $arch packages must match the iptables of this machine's agent image" >&2
  exit 1
fi
host_arch=$(dpkg --print-architecture)
pins=()
for p in "${pkgs[@]}"; do
  v=$(dpkg-query -W -f '${Version}' "$p:$host_arch" 2>/dev/null || dpkg-query -W -f '${Version}' "$p" 2>/dev/null) ||
    { echo "$0: $p is not installed here (apt-get install iptables): the $arch image takes the versions of this machine's" >&2; exit 1; }
  pins+=("$p=$v")
done
key=$(printf '%s\n' "$VERSION_CODENAME" "$arch" "${pins[@]}" | sha256sum | cut -c1-16)
dir=$cache/debian-$arch-$key
if [ -f "$dir/complete" ]; then echo "$dir"; exit 0; fi
mkdir -p "$cache" 2>/dev/null || { echo "$0: cannot create $cache: run as root or set INPOD_CACHE_DIR" >&2; exit 1; }
# Two builds on a cold cache (make release beside go test ./release/) fetch
# once: the second waits for the first.
exec 9>"$cache/.debian-$arch.lock"
flock 9
if [ -f "$dir/complete" ]; then echo "$dir"; exit 0; fi

echo "fetching Debian $VERSION_CODENAME $arch packages for the agent image into $dir" >&2
work=$(mktemp -d "$cache/.debian-$arch.XXXXXX")
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/debs" "$work/root"
: >"$work/apt/status"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
{
  for suite in "$VERSION_CODENAME" "$VERSION_CODENAME-updates"; do
    echo "deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian $suite main"
  done
  echo "deb [arch=$arch signed-by=$keyring] http://deb.debian.org/debian-security $VERSION_CODENAME-security main"
} >"$work/apt/sources.list"
apt=(apt-get -qq
  -o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State=$work/apt" -o "Dir::State::status=$work/apt/status" -o "Dir::Cache=$work/apt/cache"
  -o "APT::Architecture=$arch" -o "APT::Architectures::=$arch" -o Debug::NoLocking=1
  -o APT::Sandbox::User=root)
"${apt[@]}" update
if ! (cd "$work/debs" && "${apt[@]}" download "${pins[@]}"); then
  echo "$0: Debian's $VERSION_CODENAME suites have no $arch build of one of: ${pins[*]} (the versions installed here; a newer point release may have replaced one): upgrade these packages here (apt-get update && apt-get upgrade), then build again" >&2
  exit 1
fi
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
printf '%s\n' "${pins[@]}" >"$work/packages"
sed -n 's/^iptables=//p' "$work/packages" >"$work/iptables.version"
rm -rf "$work/apt"
touch "$work/complete"
rm -rf "$dir"; mv "$work" "$dir"; trap - EXIT
echo "$dir"
