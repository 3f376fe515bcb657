package redirect_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/inpod-dev/inpod/agent/redirect"
	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
	"github.com/inpod-dev/inpod/netns/netnstest"
)

// podRulesOnThisMachine names what of a pod's rule set is in this
// machine's own netns: nothing, as long as the engine stays in the pod's.
// (The node's host probes live in a table of their own, inpod-host.)
func podRulesOnThisMachine(t *testing.T) string {
	t.Helper()
	var found []string
	if out, err := exec.Command("nft", "list", "table", "inet", "inpod").CombinedOutput(); err == nil {
		found = append(found, "nftables table inet inpod:\n"+string(out))
	}
	for _, ip := range []string{"-4", "-6"} {
		out, err := exec.Command("ip", ip, "rule", "show", "pref", fmt.Sprint(redirect.RulePriority)).CombinedOutput()
		if err == nil && strings.Contains(string(out), fmt.Sprintf("lookup %d", redirect.RouteTable)) {
			found = append(found, "ip "+ip+" rule: "+string(out))
		}
	}
	for _, save := range []string{"iptables-legacy-save", "ip6tables-legacy-save"} {
		if out, err := exec.Command(save).Output(); err == nil && strings.Contains(string(out), ":INPOD") {
			found = append(found, save+" has INPOD chains")
		}
	}
	return strings.Join(found, "\n")
}

// TestEngineStaysInThePodNetns drives every operation of every backend from
// a caller in a namespace of its own and checks that neither that
// namespace nor this machine's gains or loses anything: rules written in
// the agent's netns would redirect or drop the node's own traffic, and a
// Remove that acted there would leave the pod redirected.
func TestEngineStaysInThePodNetns(t *testing.T) {
	netnstest.RequireRoot(t)
	machineBefore := podRulesOnThisMachine(t)
	for name := range backends(t) {
		t.Run(name, func(t *testing.T) {
			caller, pod := netnstest.New(t), netnstest.New(t)
			callerNS, podNS := caller.Open(t), pod.Open(t)
			engine := engineSwitchingFromTheOthers(t, name)
			callerBefore, podBefore := kernelState(t, caller), kernelState(t, pod)
			// step runs op from the caller, then checks that the backend
			// finds its rules in the pod netns or not, as it should.
			step := func(what string, op func(*os.File) error, wantPresent bool) {
				t.Helper()
				// netns.Do runs this on a thread that has joined callerNS, so
				// anything the engine does "in the caller's namespace" (a
				// netlink handle opening a socket family it was not given, a
				// socket dialled without a namespace) lands there, where the
				// test sees it, instead of in this machine's own.
				err := netns.Do(callerNS, func() error {
					if err := op(podNS); err != nil {
						return err
					}
					if present, err := engine.Backend().Present(podNS); err != nil || present != wantPresent {
						return fmt.Errorf("rules present after %s: %v (%v), want %v", what, present, err, wantPresent)
					}
					return nil
				})
				if err != nil {
					t.Fatalf("%s: %v", what, err)
				}
				if got := kernelState(t, caller); got != callerBefore {
					t.Errorf("%s changed the caller's netns:\n%s", what, lineDiff(callerBefore, got))
				}
			}

			step("Apply", func(ns *os.File) error { _, err := engine.Apply(ns, redirect.Options{}); return err }, true)
			if kernelState(t, pod) == podBefore {
				t.Fatal("Apply left the pod netns as it was: the test would prove nothing")
			}
			step("Remove", func(ns *os.File) error { _, err := engine.Remove(ns); return err }, false)
			if got := withoutHandles(kernelState(t, pod)); got != withoutHandles(podBefore) {
				t.Errorf("Remove left the pod netns changed:\n%s", lineDiff(podBefore, got))
			}
		})
	}
	if got := podRulesOnThisMachine(t); got != machineBefore {
		t.Errorf("the engine changed this machine's own netns:\nbefore:\n%s\nafter:\n%s", machineBefore, got)
	}
}

// engineSwitchingFromTheOthers is the named backend's engine as a node that
// switched backends runs it: it also removes the others' leftovers, so
// every backend's Present and Remove run too.
func engineSwitchingFromTheOthers(t *testing.T, name string) *redirect.Engine {
	t.Helper()
	var backend redirect.Backend
	var others []redirect.Backend
	for other, newBackend := range backends(t) {
		if other == name {
			backend = newBackend()
		} else {
			others = append(others, newBackend())
		}
	}
	return redirect.NewEngine(backend, others...)
}

// TestEngineLeaksNoFileDescriptors runs many pods' worth of every
// operation: the agent does them by the thousand over its life, and each
// opens netlink sockets in the pod netns; one left open per pod would run
// the agent out of descriptors and keep dead pods' namespaces alive.
func TestEngineLeaksNoFileDescriptors(t *testing.T) {
	netnstest.RequireRoot(t)
	for name := range backends(t) {
		t.Run(name, func(t *testing.T) {
			engine := engineSwitchingFromTheOthers(t, name)
			pod := netnstest.New(t).Open(t)
			cycle := func() {
				t.Helper()
				if _, err := engine.Apply(pod, redirect.Options{}); err != nil {
					t.Fatal(err)
				}
				// Twice: the second Apply takes the path that finds the
				// rules intact.
				if _, err := engine.Apply(pod, redirect.Options{}); err != nil {
					t.Fatal(err)
				}
				if _, err := engine.Backend().Present(pod); err != nil {
					t.Fatal(err)
				}
				if _, err := engine.Remove(pod); err != nil {
					t.Fatal(err)
				}
			}
			testkit.RequireNoFDLeak(t, 20, "apply/present/remove cycles", cycle)
		})
	}
}
