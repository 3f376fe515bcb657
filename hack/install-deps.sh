#!/usr/bin/env bash
# Installs what building and testing inpod needs and is missing: Debian
# packages for the kernel-facing tests and code generation, and pinned Go
# tools into ./bin. Safe to re-run; does nothing when all is present.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

# command → Debian package
declare -A pkgs=(
  [iptables]=iptables
  [iptables-restore]=iptables
  [nft]=nftables
  [ip]=iproute2
  [ss]=iproute2
  [ipset]=ipset
  [conntrack]=conntrack
  [protoc]=protobuf-compiler
  [containerd]=containerd
  [runc]=runc
  [python3]=python3
  # runs the arm64 images' programs in release's tests
  [qemu-aarch64-static]=qemu-user-static
)
missing=()
for cmd in "${!pkgs[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${pkgs[$cmd]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing packages: ${missing[*]} (install them as root with apt-get)" >&2
    exit 1
  fi
  echo "installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's iptables packages of the other image platform, unpacked into a
# cache (hack/debian-root.sh; the release build would fetch them itself).
case "$(go env GOARCH)" in
  amd64) "$repo/hack/debian-root.sh" arm64 >/dev/null ;;
  arm64) "$repo/hack/debian-root.sh" amd64 >/dev/null ;;
esac

# Go tools, pinned; protoc-gen-go follows the protobuf runtime in go.mod so
# that `make generate` reproduces the committed code byte for byte.
mkdir -p "$repo/bin"
protobuf_version=$(cd "$repo" && go list -m -f '{{.Version}}' google.golang.org/protobuf)
install_tool() { # name package@version [ldflags]
  local stamp="$repo/bin/.$1-${2##*@}${3:+-$(cksum <<<"$3" | cut -d' ' -f1)}"
  if [ ! -x "$repo/bin/$1" ] || [ ! -e "$stamp" ]; then
    echo "installing $2" >&2
    GOBIN="$repo/bin" go install ${3:+-ldflags "$3"} "$2"
    rm -f "$repo/bin/.$1-"*; touch "$stamp"
  fi
}
install_tool protoc-gen-go "google.golang.org/protobuf/cmd/protoc-gen-go@$protobuf_version"
install_tool staticcheck "honnef.co/go/tools/cmd/staticcheck@v0.8.2"
# helm as its release binaries are built: its version, and the Kubernetes
# version helm template assumes without --kube-version, its client-go's (a
# plain go install says 1.20, which the chart's kubeVersion refuses).
helm_version=v3.22.0
helm_gomod=$(go mod download -json "helm.sh/helm/v3@$helm_version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
k8s_minor=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$helm_gomod")
[ -n "$k8s_minor" ] || { echo "cannot read helm $helm_version's client-go version from $helm_gomod" >&2; exit 1; }
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$helm_version"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
install_tool helm "helm.sh/helm/v3/cmd/helm@$helm_version" "$helm_ldflags"
install_tool golangci-lint "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0"
