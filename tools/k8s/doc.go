//go:build tools

// Package k8s pins the Kubernetes version the test harness builds: importing
// the commands' packages keeps their whole dependency graph in go.sum, and
// hack/k8s-bins.sh builds the mains from k8s.io/kubernetes/cmd/... .
package k8s

import (
	_ "k8s.io/kubectl/pkg/cmd"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-proxy/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
