# The inpod-waitready image (the init container of gate value initcontainer)
# for people who build with Docker:
#   docker build -f deploy/images/inpod-waitready.Dockerfile -t inpod-waitready:dev .
# `make images` builds the same image without Docker (release/), which
# the tests use; this file is not used by any test.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/inpod-waitready ./cmd/inpod-waitready

# The static binary alone, as a non-root user: it runs in every enrolled
# pod, unprivileged, and needs nothing but the pod's /proc.
FROM scratch
COPY --from=build /out/inpod-waitready /usr/local/bin/inpod-waitready
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/inpod-waitready"]
