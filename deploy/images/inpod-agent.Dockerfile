# The inpod-agent image for people who build with Docker:
#   docker build -f deploy/images/inpod-agent.Dockerfile -t inpod-agent:dev .
# `make images` builds the same layout without Docker (release/), which
# the tests and the demo use; this file is not used by any test.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/ ./cmd/inpod-agent ./cmd/inpod-probe ./cmd/inpod-cni ./cmd/inpod-cni-apicheck

# Debian's iptables for the iptables-nft and iptables-legacy backends; the
# default backend (nftables over netlink) needs nothing from the image.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends iptables && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/inpod-agent /out/inpod-probe /usr/local/bin/
# --cni-source-dir: the agent copies these onto each node's CNI bin dir.
COPY --from=build /out/inpod-cni /out/inpod-cni-apicheck /opt/inpod/bin/
ENTRYPOINT ["/usr/local/bin/inpod-agent"]
