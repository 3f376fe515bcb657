// Command inpod-cni is the chained CNI plugin that hands each enrolled pod to
// the inpod node agent for redirection; see package plugin.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/inpod-dev/inpod/plugin"
)

func main() {
	skel.PluginMainFuncs(plugin.New().Funcs(), version.All, "inpod-cni: chained CNI plugin that gates enrolled pods on in-pod redirection")
}
