package plugin

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/inpod-dev/inpod/agent/cniserver"
	"github.com/inpod-dev/inpod/cnievent"
)

// FuzzParseChained feeds the plugin what a runtime hands it on stdin (the
// config with a prevResult) and in CNI_ARGS. Properties: no panic; a parsed
// config is complete (type, version, socket, positive timeout) and survives
// a marshal/parse round trip; and a request built from what parsed is one
// the agent's server accepts. The last one matters most: the agent refusing
// the plugin's own request fails the ADD of every pod, enrolled or not.
func FuzzParseChained(f *testing.F) {
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/cni-1"}],` +
		`"ips":[{"address":"198.51.100.9/24","gateway":"198.51.100.1","interface":0},{"address":"fd42::9/64"}]}`
	for _, seed := range []struct{ conf, args string }{
		{`{"cniVersion":"1.0.0","name":"podnet","type":"inpod-cni","prevResult":` + prev + `}`,
			"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1;K8S_POD_UID=0b5a3f9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b;K8S_POD_INFRA_CONTAINER_ID=abc"},
		{`{"cniVersion":"1.1.0","name":"podnet","type":"inpod-cni","agentSocket":"/run/inpod/cni.sock","timeout":"30s",` +
			`"excludeNamespaces":["kube-system"],"apiAccess":"/etc/cni/net.d/inpod-api-access","passList":"/run/inpod/pass",` +
			`"runtimeConfig":{"portMappings":[]},"prevResult":` + prev + `}`, "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns"},
		{`{"cniVersion":"0.4.0","name":"podnet","type":"inpod-cni","prevResult":{"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.0.0.5/24"}]}}`, "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"},
		{`{"cniVersion":"0.3.1","name":"podnet","type":"inpod-cni","prevResult":{"cniVersion":"0.3.1","ips":[{"version":"6","address":"fd00::5/64"}]}}`, ""},
		{`{"cniVersion":"0.2.0","name":"podnet","type":"inpod-cni","prevResult":{"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.5/24"}}}`, "K8S_POD_NAME=x"},
		{`{"cniVersion":"1.0.0","name":"podnet","type":"inpod-cni","prevResult":{"cniVersion":"1.0.0","ips":[{}]}}`, "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"},
		{`{"cniVersion":"1.0.0","name":"podnet","type":"inpod-cni","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.5/24"},{"address":"10.0.1.5/24"},{"address":"10.0.2.5/24"},{"address":"10.0.3.5/24"},{"address":"10.0.4.5/24"},{"address":"10.0.5.5/24"},{"address":"10.0.6.5/24"},{"address":"10.0.7.5/24"},{"address":"10.0.8.5/24"},{"address":"10.0.9.5/24"},{"address":"10.0.10.5/24"},{"address":"10.0.11.5/24"},{"address":"10.0.12.5/24"},{"address":"10.0.13.5/24"},{"address":"10.0.14.5/24"},{"address":"10.0.15.5/24"},{"address":"10.0.16.5/24"},{"address":"10.0.17.5/24"},{"address":"10.0.18.5/24"},{"address":"10.0.19.5/24"}]}}`, "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"},
		{`{"cniVersion":"1.0.0","name":"podnet","type":"inpod-cni","timeout":"-1s"}`, "bogus"},
		{`{"cniVersion":"1.0.0","name":"podnet","type":"bridge","unknown":1}`, ";;="},
		{`{"cniVersion":"1.1.0","name":"podnet","type":"inpod-cni","cni.dev/valid-attachments":[{"containerID":"c","ifname":"eth0"}]}`, ""},
	} {
		f.Add([]byte(seed.conf), seed.args)
	}
	srv, err := cniserver.New(cniserver.Config{Handler: noHandler{}})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, stdin []byte, cniArgs string) {
		conf, err := ParseConfig(stdin)
		if err != nil {
			if conf != nil {
				t.Fatalf("ParseConfig returned a config with error %v", err)
			}
			return
		}
		if conf.Type != PluginType || conf.CNIVersion == "" || conf.AgentSocket == "" || conf.timeout <= 0 {
			t.Fatalf("ParseConfig accepted an incomplete config: %+v", conf)
		}
		again, err := json.Marshal(conf)
		if err != nil {
			t.Fatalf("marshal a parsed config: %v", err)
		}
		conf2, err := ParseConfig(again)
		if err != nil {
			t.Fatalf("a parsed config does not parse again: %v\n%s", err, again)
		}
		if conf2.AgentSocket != conf.AgentSocket || conf2.timeout != conf.timeout || conf2.APIAccess != conf.APIAccess ||
			conf2.PassList != conf.PassList || strings.Join(conf2.ExcludeNamespaces, "\x00") != strings.Join(conf.ExcludeNamespaces, "\x00") {
			t.Fatalf("round trip changed the config:\n%+v\n%+v", conf, conf2)
		}

		k, argsErr := parseK8sArgs(cniArgs)
		chained, prev, ips, err := parseChained(stdin, "ADD")
		if err != nil {
			return
		}
		if string(prev) != string(chained.PrevResult) {
			t.Fatal("the pass-through result differs from the prevResult received")
		}
		for _, ip := range ips {
			if _, err := netip.ParseAddr(ip); err != nil {
				t.Fatalf("parseChained extracted %q, not an IP", ip)
			}
		}
		if argsErr != nil || k.Name == "" || k.Namespace == "" {
			return
		}
		// The runtime's identity of a real pod, and the IPs as parsed: the
		// agent must accept the plugin's request.
		k.Namespace, k.Name, k.UID = "default", "web-1", "0b5a3f9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
		req := request(cnievent.Add, k, &skel.CmdArgs{ContainerID: "abc123", Netns: "/var/run/netns/cni-1", IfName: "eth0"}, ips)
		if err := srv.Validate(req); err != nil {
			t.Fatalf("the agent refuses the plugin's request built from a prevResult the plugin accepted: %v\nprevResult: %s", err, prev)
		}
	})
}

type noHandler struct{}

func (noHandler) Add(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
func (noHandler) Del(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
func (noHandler) Check(context.Context, *cnievent.Request) (cnievent.Outcome, error) {
	return cnievent.Failed, nil
}
