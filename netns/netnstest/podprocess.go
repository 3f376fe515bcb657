package netnstest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/inpod-dev/inpod/internal/testkit"
	"github.com/inpod-dev/inpod/netns"
)

// RunAsPod starts a process inside n, in a cgroup named as the kubelet
// names a pod's (cgroupfs driver: .../pod<uid>), so a procfs scan finds it as that pod's; it returns once the
// process is in n, and kills it and removes the cgroups at cleanup. It
// skips t where no writable cgroup v1 pids hierarchy exists.
func (n *NetNS) RunAsPod(t testing.TB, uid string) {
	t.Helper()
	// A parent of this call's own: tests in parallel processes never
	// remove one another's.
	parent := filepath.Join("/sys/fs/cgroup/pids", "inpod-test-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	dir := filepath.Join(parent, "pod"+uid)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Skipf("needs a writable cgroup v1 pids hierarchy: %v", err)
	}
	cmd := exec.Command("ip", "netns", "exec", n.Name, "sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.Remove(dir)
		os.Remove(parent)
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	// `ip netns exec` enters n after the fork: wait until it has, or a
	// scan could see the process still in the caller's netns.
	want, err := netns.IdentityOfPath(n.Path)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the process inside netns "+n.Name, func() bool {
		got, err := netns.IdentityOfPath(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
		return err == nil && got == want
	})
}
