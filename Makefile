# inpod — `make test` is the one command that prepares a machine and runs
# every test tier; see README.md.

SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
export PATH := $(BIN):$(PATH)

# The protoc release whose output is committed in zds/zdspb (Debian 12's).
PROTOC_VERSION := 3.21.12

.PHONY: all help deps build generate check-generated lint test test-unit test-fuzz fuzz test-integration test-e2e bench-scale \
	soak bench k8s-bins cluster-up cluster-down clean images release manifests chart-docs check-chart demo demo-down

all: build

# Each target's "## [group] text" puts it in a group of make help.
help: ## [start] list the targets by purpose
	@awk 'BEGIN { FS = ":.*## "; n = split("start build check measure node", order, " "); \
	    title["start"] = "Start here"; title["build"] = "Build and generate"; title["check"] = "Test tiers and checks"; \
	    title["measure"] = "Measure"; title["node"] = "The local node" } \
	  /^[a-z][a-z0-9-]*:.*## \[[a-z]+\] / { g = $$2; sub(/^\[/, "", g); sub(/\].*/, "", g); d = $$2; sub(/^\[[a-z]+\] /, "", d); \
	    lines[g] = lines[g] sprintf("  %-18s %s\n", $$1, d) } \
	  END { for (i = 1; i <= n; i++) if (lines[order[i]] != "") printf "%s\n%s\n", title[order[i]], lines[order[i]] }' $(MAKEFILE_LIST)

deps: ## [build] install the tools the build and tests need (staticcheck, protoc-gen-go, ...) into ./bin
	@hack/install-deps.sh

# Stripped: inpod-cni is copied to every node and exec'ed once per pod.
build: ## [build] the binaries, into ./bin
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/ ./cmd/...

# The shipped images without Docker (release/, inpod-release), each an OCI
# image index for linux/amd64 and linux/arm64 in an OCI layout tarball:
# inpod-agent (with the iptables tools of Debian's packages of each arch),
# inpod-controller and inpod-waitready (the init container), plus
# values-release.yaml pinning them by digest. Same commit, same digests. TAG
# names the version. The ztunnel stand-in (a test peer) is no release image:
# the demo and the e2e tests build it themselves.
TAG ?= dev
# The platforms of each image's index; the demo builds this machine's only.
PLATFORMS ?= amd64,arm64
RELEASE = $(GO) run ./release/cmd/inpod-release --tag $(TAG) --platforms $(PLATFORMS)
images: ## [build] the shipped images inpod-agent, inpod-controller, inpod-waitready (OCI indexes, amd64+arm64) into ./bin/images (no Docker)
	@command -v xtables-nft-multi >/dev/null || hack/install-deps.sh
	$(RELEASE) --out $(BIN)/images --chart ''

# What a release publishes, into ./bin/release: the images as make images
# builds them, values-release.yaml, and the chart packaged by helm (version
# and appVersion from TAG when it is a semantic version, v1.2.3; else
# Chart.yaml's), each printed with its digest (docs/install.md, Release
# artifacts).
release: deps ## [build] the image tarballs, the packaged chart and values-release.yaml (images by digest) into ./bin/release
	$(RELEASE) --out $(BIN)/release --chart deploy/helm/inpod --helm $(BIN)/helm

generate: deps ## [build] regenerate zds/zdspb from zds.proto
	@protoc --version | grep -q ' $(PROTOC_VERSION)$$' || \
	  { echo "protoc $(PROTOC_VERSION) is required for byte-identical output; have: $$(protoc --version)" >&2; exit 1; }
	cd zds/zdspb && protoc --go_out=. --go_opt=paths=source_relative zds.proto

# Fails when the committed generated code differs from what `make generate`
# writes.
check-generated: generate ## [check] fail when the committed generated code is stale
	@git diff --exit-code -- zds/zdspb || \
	  { echo "zds/zdspb is out of date: run 'make generate' and commit" >&2; exit 1; }

# The plain manifests committed beside the chart, rendered from it: the
# default install (deploy/manifests/inpod.yaml) and the RBAC the agent's
# integration tests apply (deploy/rbac). One source: the chart.
manifests: deps ## [build] render deploy/manifests and deploy/rbac from the chart
	@hack/manifests.sh

# The chart's README (deploy/helm/inpod/README.md): its prose from
# README.md.gotmpl, a row per value from values.yaml's comments and
# values.schema.json (internal/chartdoc). Fails, naming them, when a value
# has no description or values.yaml and the schema disagree.
chart-docs: ## [build] regenerate the chart README (deploy/helm/inpod/README.md) from values.yaml and values.schema.json
	$(GO) run ./internal/chartdoc/cmd/chartdoc -chart deploy/helm/inpod

# helm lint and template per gate value, the schema's refusals, NOTES.txt
# per gate, the chart README and the rendered manifests current (like
# check-generated).
check-chart: deps ## [check] helm lint/template per gate value; the chart README, deploy/manifests and deploy/rbac current
	@hack/chart-check.sh
	@hack/manifests.sh --check

lint: deps ## [check] gofmt, go vet, staticcheck, golangci-lint (import rules, misspell, goimports), links in the docs
	@fmt=$$(git ls-files -co --exclude-standard '*.go' | xargs -r gofmt -l); \
	  if [ -n "$$fmt" ]; then echo "gofmt would change:"; echo "$$fmt"; exit 1; fi
	$(GO) vet ./...
	staticcheck ./...
	golangci-lint run ./...
	@python3 hack/check-links.py .

# Every tier, fastest first, so a failure shows in minutes: lint and
# check-generated, then unit, then integration, then e2e; each step is its
# own make run, so the order holds under make -j too. The unit tier needs
# root: it creates network namespaces and real netfilter rules (each test
# cleans up after itself). Integration tests
# (TestIntegration*, build tag integration) run against a real etcd and
# kube-apiserver; end-to-end tests (TestE2E*, tag e2e) against a real
# single node. Both run one package at a time: each start picks free ports,
# and a parallel package could take one between the pick and the bind; the
# e2e packages also share the host's fixed kubelet paths.
# Both get their binaries from k8s-bins (cold: ~17 min).
test: ## [start] every tier, fastest first (lint, check-generated, check-chart, unit, fuzz, integration, e2e); the time of each at the end
	@MAKE="$(MAKE)" hack/test-tiers.sh lint check-generated check-chart test-unit test-fuzz test-integration test-e2e

# -timeout 20m: go test's own 10 min per package is too tight for release/,
# which builds every shipped image for two platforms (minutes on a cold cache).
test-unit: deps ## [check] unit tier (root: real netns and netfilter), minutes
	INPOD_TEST_CNI_PLUGINS=$$(hack/cni-bins.sh) $(GO) test -race -count=1 -timeout 20m ./...

# Go fuzz targets (func FuzzX(f *testing.F), each beside the code it feeds),
# found by grep so a new one is run without editing this file. go test
# fuzzes one target per invocation. Their seeds, and every crasher found
# (testdata/fuzz/FuzzX/), also run as plain tests in test-unit.
# A duration can end in a spurious "context deadline exceeded" on Go < 1.27
# (see test-fuzz); rerun, or give a count (FUZZTIME=1000000x).
FUZZTIME ?= 60s
fuzz_targets = $(shell grep -rl --include='*_test.go' '^func Fuzz' . | sort | xargs -r grep -H -o '^func Fuzz[A-Za-z0-9_]*' | sed 's|^\(.*\)/[^/]*_test.go:func |\1 |')

fuzz: ## [check] every fuzz target for FUZZTIME each (default 60s), one after another
	@set -e; printf '%s %s\n' $(fuzz_targets) | while read -r pkg target; do \
	  echo "== $$target ($$pkg, $(FUZZTIME))"; \
	  $(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) "$$pkg" </dev/null; \
	done

# A count, not a duration: with -fuzztime <duration>, Go's fuzz coordinator
# can report its own deadline as a failure ("context deadline exceeded", no
# crasher) when a loaded machine starves its workers (go.dev/issue/75804,
# fixed in Go 1.27); a count has no deadline to race. 20000 inputs take 1-3 s
# a target here.
test-fuzz: ## [check] every fuzz target for 20000 inputs (the bounded run in make test)
	@$(MAKE) --no-print-directory fuzz FUZZTIME=20000x

# Binaries for the Kubernetes tiers, built once and cached by version.
# kubectl: two e2e tests apply and exec with it, and the person at the node uses it.
K8S_ENV = INPOD_K8S_BIN_DIR=$$(hack/k8s-bins.sh kubectl) INPOD_TEST_CNI_PLUGINS=$$(hack/cni-bins.sh)
K8S_ENV_PERSON = $(K8S_ENV)

tagged_pkgs = $(shell grep -rl --include='*_test.go' '^//go:build $(1)' . | xargs -r -n1 dirname | sort -u)

test-integration: deps ## [check] TestIntegration* against a real etcd + kube-apiserver
	$(K8S_ENV) $(GO) test -p 1 -race -count=1 -timeout 30m -tags integration -run '^TestIntegration' $(call tagged_pkgs,integration)

# The e2e package runs TestE2ESoak too, 3 minutes of churn and faults (plus
# its set-up and checks): hence more than 30 minutes for the tier.
# Under the same lock as make soak, make bench and make demo: they all use
# the host's fixed kubelet and CNI paths, so a second run waits its turn.
# On failure the failed tests' own lines are printed again at the end.
E2E_LOG := $(BIN)/test-e2e.log
test-e2e: deps ## [check] TestE2E* on a real single node (kubelet, containerd)
	@mkdir -p $(BIN)
	set -o pipefail; $(K8S_ENV) flock /tmp/inpod-e2e.lock $(GO) test -p 1 -count=1 -timeout 60m -tags e2e -run '^TestE2E' $(call tagged_pkgs,e2e) 2>&1 | tee $(E2E_LOG) \
	  || { hack/failure-recap.sh $(E2E_LOG); exit 1; }

# The long soak: INPOD_SOAK_DURATION of churn and faults on the real node,
# continued until 500 pods were created (about 20 a minute on a loaded
# two-core machine); INPOD_SOAK_SEED=<printed seed> replays a run.
INPOD_SOAK_DURATION ?= 20m
soak: deps ## [measure] TestE2ESoak for INPOD_SOAK_DURATION (default 20m, >= 500 pods) under the e2e lock
	$(K8S_ENV) INPOD_SOAK_DURATION=$(INPOD_SOAK_DURATION) INPOD_SOAK_MIN_PODS=500 flock /tmp/inpod-e2e.lock \
	  $(GO) test -count=1 -timeout 60m -tags e2e -run '^TestE2ESoak$$' -v ./e2e/

# Benchmarks print medians, p99s and ratios against floors measured in the
# same run. Each benchmark also appends its figures to BENCH_FIGURES
# (internal/benchreport), which the last step renders as one table:
# printed, and written to docs/benchmarks.md (linked from the README).
BENCH_FIGURES := $(BIN)/bench-figures.jsonl
BENCH = INPOD_BENCH_REPORT=$(BENCH_FIGURES) $(GO) test -count=1 -run '^$$'
bench: deps ## [measure] every benchmark; one report of every figure next to its floor, into docs/benchmarks.md
	@mkdir -p $(BIN) && : > $(BENCH_FIGURES)
	$(BENCH) -bench . -benchtime 2000x ./zds/
	$(BENCH) -bench . -benchtime 200x ./agent/redirect/
	$(BENCH) -bench . -benchtime 200x ./agent/podnetns/
	$(BENCH) -bench VerifyAll -benchtime 3x ./agent/enroll/
	INPOD_TEST_CNI_PLUGINS=$$(hack/cni-bins.sh) $(BENCH) -bench . -benchtime 100x ./plugin/
	$(BENCH) -bench . -benchtime 200x ./deviceplugin/
	$(K8S_ENV) $(BENCH) -tags integration -bench DRAGateFlip -benchtime 100x -timeout 10m ./dra/
	$(K8S_ENV) $(BENCH) -tags integration -bench Enrollment -benchtime 1x -timeout 20m ./agent/
	$(K8S_ENV) $(BENCH) -tags integration -bench TaintRemoval -benchtime 1x -timeout 10m ./taintcontroller/
# The headline: pod start-up (create → Ready), enrolled pods against pods
# outside the mesh on a real node per gate mode (tag e2e, under the e2e
# lock); benchreport.HeadlineSection puts it first in the report.
	$(K8S_ENV) flock /tmp/inpod-e2e.lock env $(BENCH) -tags e2e -bench E2EPodStartup -benchtime 1x -timeout 70m ./e2e/
	$(call scale_benchmarks,$(BENCH_FIGURES))
	$(GO) run ./internal/benchreport/cmd/benchreport -in $(BENCH_FIGURES) -out $(CURDIR)/docs/benchmarks.md

# Past one node: what each gate costs the cluster's shared parts (the
# scheduler, admission, the taint controller, the agent's informers) on a
# real etcd + kube-apiserver + kube-scheduler with simulated nodes (Node
# objects, no kubelets), each beside the same run without inpod. Sizes:
# INPOD_SCALE_NODES (default 1000), INPOD_SCALE_PODS (5 a node) and
# INPOD_SCALE_ROUNDS (3, interleaved; DRA once) for scheduling, then
# INPOD_SCALE_LARGE_NODES (5000), INPOD_SCALE_LARGE_PODS (one a node) and
# INPOD_SCALE_LARGE_ROUNDS (1, DRA included), INPOD_SCALE_TAINT_NODES (5000) for the taint controller,
# INPOD_BENCH_ADMISSION_PODS (1500 a stream, at 100/s),
# INPOD_BENCH_AGENT_SCALE (1: 10,000 namespaces, 100,000 pods).
# No local node: it needs no e2e lock, but a quiet machine.
define scale_benchmarks
	$(K8S_ENV) INPOD_BENCH_REPORT=$(1) $(GO) test -count=1 -run '^$$' -tags integration -bench IntegrationScale -benchtime 1x -timeout 100m -v ./e2e/scale/
	$(K8S_ENV) INPOD_BENCH_REPORT=$(1) $(GO) test -count=1 -run '^$$' -tags integration -bench IntegrationAdmission -benchtime 1x -timeout 20m -v ./deploy/
	$(K8S_ENV) INPOD_BENCH_REPORT=$(1) $(GO) test -count=1 -run '^$$' -tags integration -bench IntegrationAgentInformersAtScale -benchtime 1x -timeout 40m -v ./agent/
endef
SCALE_FIGURES := $(BIN)/bench-scale-figures.jsonl
bench-scale: deps ## [measure] past one node: each gate's cost to the scheduler, admission, the taint controller and the agent at 1,000-5,000 simulated nodes; prints the table and puts it in docs/benchmarks.md (~45 min)
	@mkdir -p $(BIN) && : > $(SCALE_FIGURES)
	$(call scale_benchmarks,$(SCALE_FIGURES))
	$(GO) run ./internal/benchreport/cmd/benchreport -in $(SCALE_FIGURES) -update $(CURDIR)/docs/benchmarks.md -by 'make bench-scale'

# Pinned Kubernetes and etcd binaries for the test node, cached outside the
# repo (INPOD_CACHE_DIR, default /var/cache/inpod): ~17 min cold, seconds warm.
k8s-bins: ## [node] build and cache the pinned Kubernetes (with kubectl), etcd and CNI binaries (~17 min cold)
	@hack/k8s-bins.sh kubectl
	@hack/cni-bins.sh

# A real single-node Kubernetes for a person: prints the kubeconfig path.
cluster-up: deps ## [node] a real single-node Kubernetes for a person; prints its kubeconfig
	CGO_ENABLED=0 $(GO) build -o $(BIN)/localnode ./e2e/cmd/localnode
	$(K8S_ENV_PERSON) $(BIN)/localnode up --repo $(CURDIR)

cluster-down: ## [node] stop what cluster-up started
	CGO_ENABLED=0 $(GO) build -o $(BIN)/localnode ./e2e/cmd/localnode
	$(BIN)/localnode down

# inpod doing its job on the local node, narrated step by step; leaves the
# node up (make demo-down removes everything). The node uses fixed host
# paths, so it starts under the e2e lock, and its processes keep holding it
# (inherited) until demo-down stops them; a node already up is reused.
NODE_UP = [ -e /var/lib/inpod-e2e.holder ] && kill -0 $$(cat /var/lib/inpod-e2e.holder) 2>/dev/null
demo: deps ## [start] bring up the local node, install inpod with its chart, show an enrolled pod gated and redirected
	$(MAKE) --no-print-directory images PLATFORMS=$$($(GO) env GOARCH)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/localnode ./e2e/cmd/localnode
	CGO_ENABLED=0 $(GO) build -o $(BIN)/demo ./e2e/cmd/demo
	if $(NODE_UP); then lock=; else lock="flock /tmp/inpod-e2e.lock"; fi; \
	  $(K8S_ENV_PERSON) $$lock $(BIN)/demo up --repo $(CURDIR) --images $(BIN)/images

demo-down: deps ## [start] uninstall inpod (helm) and remove the local node
	CGO_ENABLED=0 $(GO) build -o $(BIN)/localnode ./e2e/cmd/localnode
	CGO_ENABLED=0 $(GO) build -o $(BIN)/demo ./e2e/cmd/demo
	$(BIN)/demo down --repo $(CURDIR)

clean: ## [build] remove ./bin
	rm -rf $(BIN)
