package enroll

import (
	"testing"

	"k8s.io/apimachinery/pkg/types"
)

// lockIfFree takes a pod's lock only when no one holds it, and leaves no
// trace when it does not: what ReconcileIfFree relies on not to wait
// behind an ADD that waits for ztunnel.
func TestLockIfFreeNeverWaits(t *testing.T) {
	p := &Pipeline{locks: map[types.UID]*podLock{}}
	unlock := p.lock("u1")
	if _, ok := p.lockIfFree("u1"); ok {
		t.Fatal("lockIfFree took a lock someone holds")
	}
	other, ok := p.lockIfFree("u2")
	if !ok {
		t.Fatal("lockIfFree did not take another pod's free lock")
	}
	other()
	unlock()
	again, ok := p.lockIfFree("u1")
	if !ok {
		t.Fatal("lockIfFree did not take the lock once released")
	}
	again()
	if len(p.locks) != 0 {
		t.Fatalf("locks left behind: %v", p.locks)
	}
}
