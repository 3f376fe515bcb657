// Package apichecktest serves pod and namespace labels the way the API
// server does, over TLS, for tests of the agent-down check.
package apichecktest

import (
	"encoding/json"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/apiaccess"
)

// Token is the only bearer token the fake accepts.
const Token = "test-token"

// Serve answers GETs of /api/v1/namespaces/NS/pods/NAME and
// /api/v1/namespaces/NS with the labels given (keys "ns/name" and "ns"),
// 404 with a Status for anything else and 401 without Token. ln is where to
// listen (nil: a loopback port of the caller's netns). The server stops
// with the test.
func Serve(t testing.TB, ln net.Listener, pods, namespaces map[string]map[string]string) *apiaccess.Access {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+Token {
			w.WriteHeader(http.StatusUnauthorized)
			json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "message": "Unauthorized"})
			return
		}
		parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
		var labels map[string]string
		var ok bool
		switch {
		case len(parts) == 6 && parts[4] == "pods":
			labels, ok = pods[parts[3]+"/"+parts[5]]
		case len(parts) == 4:
			labels, ok = namespaces[parts[3]]
		}
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "message": r.URL.Path + " not found"})
			return
		}
		json.NewEncoder(w).Encode(map[string]any{"metadata": map[string]any{"labels": labels}})
	}))
	if ln != nil {
		srv.Listener.Close()
		srv.Listener = ln
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	return &apiaccess.Access{Server: srv.URL, CAData: ca, Token: Token}
}
