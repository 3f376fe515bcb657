package plugin

import (
	"bytes"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
)

func TestConfigErrorsNameTheField(t *testing.T) {
	cases := map[string]string{
		`{"cniVersion":"1.0.0","name":"n","type":"inpod-cni","agentSokcet":"/x"}`:      `unknown field "agentSokcet"`,
		`{"cniVersion":"1.0.0","name":"n","type":"inpod-cni","timeout":"soon"}`:        `field "timeout"`,
		`{"cniVersion":"1.0.0","name":"n","type":"inpod-cni","excludeNamespaces":"x"}`: `field "excludeNamespaces" has the wrong type`,
		`{"cniVersion":"1.0.0","name":"n","type":"bridge"}`:                            `field "type"`,
		`{"name":"n","type":"inpod-cni"}`:                                              `field "cniVersion"`,
		`{"cniVersion":`:                                                               `invalid network configuration`,
	}
	for conf, want := range cases {
		_, err := ParseConfig([]byte(conf))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%s) = %v, want an error containing %q", conf, err, want)
		}
	}
}

const prev = `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"address":"198.51.100.7/24","interface":0}],  "dns":{}}`

func TestAddReturnsPrevResultByteForByte(t *testing.T) {
	var out bytes.Buffer
	p := &Plugin{Stdout: &out}
	// Not a Kubernetes pod: no CNI_ARGS, so nobody is asked.
	conf := `{"cniVersion":"1.0.0","name":"n","type":"inpod-cni","prevResult":` + prev + `}`
	if err := p.Add(&skel.CmdArgs{ContainerID: "c", Netns: "/var/run/netns/x", IfName: "eth0", StdinData: []byte(conf)}); err != nil {
		t.Fatal(err)
	}
	if out.String() != prev {
		t.Fatalf("ADD printed\n%s\nwant prevResult unchanged\n%s", out.String(), prev)
	}
}

func TestAddWithoutPrevResultExplainsChaining(t *testing.T) {
	p := &Plugin{Stdout: &bytes.Buffer{}}
	err := p.Add(&skel.CmdArgs{StdinData: []byte(`{"cniVersion":"1.0.0","name":"n","type":"inpod-cni"}`)})
	if err == nil || !strings.Contains(err.Error(), `"prevResult"`) || !strings.Contains(err.Error(), "chained") {
		t.Fatalf("err = %v", err)
	}
}

func TestMalformedCNIArgs(t *testing.T) {
	if _, err := parseK8sArgs("K8S_POD_NAME"); err == nil {
		t.Fatal("CNI_ARGS element without = accepted")
	}
	k, err := parseK8sArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u")
	if err != nil || k.Namespace != "ns" || k.Name != "p" || k.UID != "u" {
		t.Fatalf("parseK8sArgs = %+v, %v", k, err)
	}
}
