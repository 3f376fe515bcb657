# inpod — `make test` is the one command that prepares a machine and runs
# every test tier; see README.md.

SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
export PATH := $(BIN):$(PATH)

# The protoc release whose output is committed in zds/zdspb (Debian 12's).
PROTOC_VERSION := 3.21.12

.PHONY: all deps build generate check-generated lint test test-unit bench k8s-bins clean

all: build

deps:
	@hack/install-deps.sh

build:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/ ./cmd/...

generate: deps
	@protoc --version | grep -q ' $(PROTOC_VERSION)$$' || \
	  { echo "protoc $(PROTOC_VERSION) is required for byte-identical output; have: $$(protoc --version)" >&2; exit 1; }
	cd zds/zdspb && protoc --go_out=. --go_opt=paths=source_relative zds.proto

# Fails when the committed generated code differs from what `make generate`
# writes.
check-generated: generate
	@git diff --exit-code -- zds/zdspb || \
	  { echo "zds/zdspb is out of date: run 'make generate' and commit" >&2; exit 1; }

lint: deps
	@fmt=$$(git ls-files -co --exclude-standard '*.go' | xargs -r gofmt -l); \
	  if [ -n "$$fmt" ]; then echo "gofmt would change:"; echo "$$fmt"; exit 1; fi
	$(GO) vet ./...
	staticcheck ./...

# Every tier. The unit tier needs root: it creates network namespaces and
# real netfilter rules (each test cleans up after itself).
test: deps lint check-generated test-unit

test-unit:
	$(GO) test -race -count=1 ./...

# Benchmarks print medians, p99s and ratios against baselines measured in
# the same run.
bench: deps
	$(GO) test -run '^$$' -bench . -benchtime 2000x ./zds/
	$(GO) test -run '^$$' -bench . -benchtime 200x ./agent/redirect/

# Pinned Kubernetes and etcd binaries for the test node, cached outside the
# repo (INPOD_CACHE_DIR, default /var/cache/inpod): ~17 min cold, seconds warm.
k8s-bins:
	@hack/k8s-bins.sh

clean:
	rm -rf $(BIN)
