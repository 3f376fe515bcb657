package cniserver

import (
	"bytes"
	"context"
	"encoding/json"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/cnievent"
)

// FuzzReadRequest feeds the server's decoding and validation what a peer
// could write to the socket. Properties: no panic; a request that passes is
// one the pipeline can trust as far as the server promises (a netns path
// clean, absolute and inside the allowed prefixes, names within
// Kubernetes' limits, IPs that parse); and it survives a marshal/decode
// round trip unchanged, so what the plugin sends is what the pipeline sees.
func FuzzReadRequest(f *testing.F) {
	for _, seed := range []string{
		`{"command":"ADD","podNamespace":"default","podName":"web-1","podUID":"0b5a3f9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b",` +
			`"containerID":"abababab","netns":"/var/run/netns/cni-1234","ifName":"eth0","ips":["198.51.100.9","fd42::9"]}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/proc/1234/ns/net"}`,
		`{"command":"CHECK","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/proc/1/task/1/ns/net"}`,
		`{"command":"DEL","podNamespace":"default","podName":"web-1","containerID":"c"}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/var/run/netns/../../etc/passwd"}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/run/netns/a/b"}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/proc/self/ns/net"}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/var/run/netns/x","ips":["::ffff:10.0.0.1","fe80::1%eth0"]}`,
		`{"command":"ADD","podNamespace":"kube-system","podName":"a.b.c","containerID":"c","netns":"/var/run/netns/x","command":"VERSION"}`,
		`{"command":"ADD","PODNAMESPACE":"default","podname":"web-1","containerID":"c","netns":"/var/run/netns/x"}`,
		`{"command":"ADD","podNamespace":"default","podName":"web-1","containerID":"c","netns":"/var/run/netns/..0"}`,
		`[1,2,3]`, `null`, `{"command":"ADD"}{"command":"DEL"}`, "",
	} {
		f.Add([]byte(seed))
	}
	s, err := New(Config{Handler: nopHandler{}})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := readRequest(bytes.NewReader(data))
		if err != nil {
			if req != nil {
				t.Fatalf("readRequest returned a request with error %v", err)
			}
			return
		}
		if err := s.Validate(req); err != nil {
			return
		}
		if req.Netns != "" {
			// A name such as "..0" is a file in the directory, not a way out of
			// it: only a whole ".." element climbs.
			if !filepath.IsAbs(req.Netns) || filepath.Clean(req.Netns) != req.Netns || slices.Contains(strings.Split(req.Netns, "/"), "..") {
				t.Fatalf("accepted netns path %q", req.Netns)
			}
			inside := strings.HasPrefix(req.Netns, "/proc/") && strings.HasSuffix(req.Netns, "/ns/net") && !strings.Contains(req.Netns, "self")
			for _, p := range []string{"/var/run/netns/", "/run/netns/"} {
				inside = inside || (strings.HasPrefix(req.Netns, p) && !strings.Contains(req.Netns[len(p):], "/"))
			}
			if !inside {
				t.Fatalf("accepted netns path %q outside the allowed locations", req.Netns)
			}
		} else if req.Command != cnievent.Del {
			t.Fatalf("accepted %s without a netns", req.Command)
		}
		if len(req.PodNamespace) == 0 || len(req.PodNamespace) > 63 || len(req.PodName) == 0 || len(req.PodName) > 253 ||
			strings.ContainsAny(req.PodNamespace+req.PodName, "/ \x00") {
			t.Fatalf("accepted pod %q/%q", req.PodNamespace, req.PodName)
		}
		if len(req.IPs) > cnievent.MaxIPs {
			t.Fatalf("accepted %d IPs", len(req.IPs))
		}
		for _, ip := range req.IPs {
			if _, err := netip.ParseAddr(ip); err != nil {
				t.Fatalf("accepted IP %q", ip)
			}
		}
		again, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		req2, err := readRequest(bytes.NewReader(again))
		if err != nil {
			t.Fatalf("re-encoded request not decodable: %v", err)
		}
		if len(req.IPs) == 0 {
			req.IPs = nil // "ips":[] and no "ips" are the same request
		}
		if !reflect.DeepEqual(req, req2) {
			t.Fatalf("round trip changed the request:\n%+v\n%+v", req, req2)
		}
		if err := s.Validate(req2); err != nil {
			t.Fatalf("round trip made a valid request invalid: %v", err)
		}
	})
}

type nopHandler struct{}

func (nopHandler) Add(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
func (nopHandler) Del(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
func (nopHandler) Check(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
