package testkit

import (
	"errors"
	"os"
	"testing"
	"time"
)

func TestPollReturnsConditionErrorAndTimesOut(t *testing.T) {
	boom := errors.New("boom")
	if err := Poll(time.Second, "x", func() (bool, error) { return false, boom }); !errors.Is(err, boom) {
		t.Fatalf("Poll = %v, want the condition's error", err)
	}
	var te *TimeoutError
	if err := Poll(20*time.Millisecond, "never", func() (bool, error) { return false, nil }); !errors.As(err, &te) || te.What != "never" {
		t.Fatalf("Poll = %v, want a timeout naming what it waited for", err)
	}
	n := 0
	if err := Poll(time.Second, "third try", func() (bool, error) { n++; return n == 3, nil }); err != nil || n != 3 {
		t.Fatalf("Poll = %v after %d tries, want success on the third", err, n)
	}
}

func TestShortTempDirFitsASocketPathAndIsRemoved(t *testing.T) {
	var dir string
	t.Run("inner", func(t *testing.T) {
		dir = ShortTempDir(t, "tk-")
		if len(dir) > 40 {
			t.Fatalf("dir %q is too long for socket paths", dir)
		}
	})
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("dir %q still there after the test: %v", dir, err)
	}
}
