package taintcontroller

import (
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
)

// fakeClient is only for validating Config; behaviour is tested on a real
// API server (integration tier).
func fakeClient() kubernetes.Interface { return fake.NewClientset() }
