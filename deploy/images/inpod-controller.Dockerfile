# The inpod-controller image (taint mode) for people who build with Docker:
#   docker build -f deploy/images/inpod-controller.Dockerfile -t inpod-controller:dev .
# `make images` builds the same image without Docker (release/), which
# the tests use; this file is not used by any test.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/inpod-controller ./cmd/inpod-controller

# The static binary alone: it only talks to the API server, with the
# service account's CA that the pod mounts. The chart runs it as a
# non-root user with a read-only root filesystem.
FROM scratch
COPY --from=build /out/inpod-controller /usr/local/bin/inpod-controller
ENTRYPOINT ["/usr/local/bin/inpod-controller"]
