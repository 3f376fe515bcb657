package codepages

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseMapping(t *testing.T) {
	for _, tc := range []struct {
		line string
		want mapping
		ok   bool
	}{
		{"00400000-01a3e000 r-xp 00000000 fe:00 1311 /opt/inpod/bin/inpod-agent",
			mapping{start: 0x400000, end: 0x1a3e000, perms: "r-xp", path: "/opt/inpod/bin/inpod-agent"}, true},
		{"7f0000000000-7f0000001000 rw-p 00000000 00:00 0 ", mapping{}, false}, // anonymous: no path
		{"01a3e000-01b00000 r--p 0163e000 fe:00 1311 /tmp/with space/bin",
			mapping{start: 0x1a3e000, end: 0x1b00000, perms: "r--p", path: "/tmp/with space/bin"}, true},
		{"zz-01 r--p 0 fe:00 1 /bin", mapping{}, false},
		{"02000000-01000000 r--p 0 fe:00 1 /bin", mapping{}, false}, // end before start
		{"", mapping{}, false},
	} {
		got, ok := parseMapping(tc.line)
		if ok != tc.ok || got != tc.want {
			t.Errorf("parseMapping(%q) = %+v, %v; want %+v, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

// The test binary's own start-up (the testing package, flag parsing) left
// pages of it mapped and cached: Release unmaps them and drops them from the
// page cache, and the program runs on, its code read back from the file.
func TestReleaseGivesBackTheBinarysPagesAndTheProgramRunsOn(t *testing.T) {
	var fs unix.Statfs_t
	if err := unix.Statfs("/proc/self/exe", &fs); err == nil && fs.Type == unix.TMPFS_MAGIC {
		// tmpfs pages are shared memory: neither RssFile nor droppable.
		t.Skip("the test binary is on tmpfs, where there is no page cache to give back")
	}
	// go test has just written this binary: until the filesystem commits
	// it, the kernel keeps its pages (as it would an image layer pulled
	// moments ago). Commit it, as time would.
	unix.Sync()
	r, err := Release()
	if errors.Is(err, unix.EINVAL) {
		t.Skipf("this kernel has no MADV_PAGEOUT (< 5.4): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("mapped %d → %d KiB, cached %d → %d KiB", r.MappedBefore>>10, r.MappedAfter>>10, r.CachedBefore>>10, r.CachedAfter>>10)
	if r.MappedAfter >= r.MappedBefore {
		t.Errorf("file-backed RSS %d KiB before Release, %d KiB after: nothing unmapped", r.MappedBefore>>10, r.MappedAfter>>10)
	}
	// What the page cache gives back is not asserted: the kernel keeps a
	// large folio whole while any page of it is mapped, and a test binary
	// of a few MiB may be held by the pages running this test. The agent's
	// benchmark reports what it frees (tens of MiB).
	if r.CachedAfter > r.CachedBefore {
		t.Errorf("the binary's page cache grew: %d KiB before Release, %d KiB after", r.CachedBefore>>10, r.CachedAfter>>10)
	}
	// The code that ran before runs again, read back from the file.
	if again, err := Release(); err != nil || again.MappedBefore <= 0 {
		t.Fatalf("a second Release: %+v, %v", again, err)
	}
}
