# TEST PEER ONLY: the ztunnel stand-in plays Istio's ztunnel on the ZDS
# socket for inpod's demo and tests; it proxies nothing. Never deploy it
# beside a real ztunnel.
#   docker build -f deploy/images/ztunnel-standin.Dockerfile -t ztunnel-standin:dev .
# The demo and the e2e tests build the same image without Docker (e2e/images); no test uses this file.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/ztunnel-standin ./cmd/ztunnel-standin

FROM scratch
COPY --from=build /out/ztunnel-standin /usr/local/bin/ztunnel-standin
ENTRYPOINT ["/usr/local/bin/ztunnel-standin"]
