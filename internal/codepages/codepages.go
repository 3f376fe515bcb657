// Package codepages gives back the memory a long-running process holds for
// code it ran once.
//
// A Go binary that links client-go runs, at start-up, the init functions of
// every API group client-go knows, and its first informer lists touch codec
// and reflection code that a steady agent never runs again. Two kinds of
// memory hold that code: the pages mapped into the process (its file-backed
// RSS; fault-around maps 64 KiB around each page touched), and the page
// cache of the binary, which exec and read-ahead fill with most of the file
// and which the container's memory cgroup is charged for whether or not a
// page is mapped. For the agent, ~38 MiB are mapped and ~61 MiB cached
// after start-up (measured, 2026-12-02), while what it runs afterwards is a
// fraction of that.
//
// Release gives both back: MADV_PAGEOUT unmaps the binary's read-only
// mappings (code, read-only data, the function table), then
// POSIX_FADV_DONTNEED drops the binary's page cache that nothing maps any
// more. Unmapping alone would leave most pages cached (measured: ~75 %),
// still charged to the container. Why it is safe: those pages are clean
// copies of the executable file, so dropping them loses nothing; a page the
// process needs again is read back from the file, exactly as at start-up.
// The kernel never drops a page something maps (the code running now, or
// the same binary run by another process) or a dirty one. Writable mappings
// (data, heap, stacks) are never touched. The cost is page faults that read
// from the file, with read-ahead, for the code the process keeps running,
// once, after the call: call it when the process is quiet.
package codepages

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Result is the process's binary in memory around a Release, in bytes: its
// file-backed RSS (RssFile: pages mapped into the process) and the
// binary's pages in the page cache (what the memory cgroup is charged for).
type Result struct {
	MappedBefore, MappedAfter int64
	CachedBefore, CachedAfter int64
}

// Freed is the page cache Release dropped: memory given back to the node.
func (r Result) Freed() int64 { return max(r.CachedBefore-r.CachedAfter, 0) }

// Release unmaps the read-only file mappings of the running executable and
// drops the executable's page cache nothing maps. Each step is best effort:
// without the right to write the file (owner, write permission,
// CAP_FOWNER or CAP_DAC_OVERRIDE) the kernel unmaps nothing, and a kernel
// without MADV_PAGEOUT (< 5.4) fails it, but the page cache nothing maps is
// still dropped. Result says what happened; the error joins what failed.
func Release() (Result, error) {
	var r Result
	exe, err := os.Open("/proc/self/exe")
	if err != nil {
		return r, fmt.Errorf("open the executable: %w", err)
	}
	defer exe.Close()
	path, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return r, fmt.Errorf("find the executable: %w", err)
	}
	var errs []error
	if r.MappedBefore, err = fileRSS(); err != nil {
		errs = append(errs, err)
	}
	if r.CachedBefore, err = cached(exe); err != nil {
		errs = append(errs, err)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		errs = append(errs, err)
	}
	for _, line := range strings.Split(string(maps), "\n") {
		m, ok := parseMapping(line)
		if !ok || m.path != path || strings.Contains(m.perms, "w") {
			continue
		}
		if _, _, errno := unix.Syscall(unix.SYS_MADVISE, m.start, m.end-m.start, unix.MADV_PAGEOUT); errno != 0 {
			errs = append(errs, fmt.Errorf("madvise(MADV_PAGEOUT) %x-%x %s: %w", m.start, m.end, m.perms, errno))
			break
		}
	}
	// Dirty pages (a binary written moments ago) are not dropped: write
	// them back first. It cannot change the file; where it fails
	// (filesystems without fsync, such as squashfs) there is nothing dirty.
	_ = unix.Fdatasync(int(exe.Fd()))
	if err := unix.Fadvise(int(exe.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		errs = append(errs, fmt.Errorf("fadvise(POSIX_FADV_DONTNEED) the executable: %w", err))
	}
	if r.MappedAfter, err = fileRSS(); err != nil {
		errs = append(errs, err)
	}
	if r.CachedAfter, err = cached(exe); err != nil {
		errs = append(errs, err)
	}
	return r, errors.Join(errs...)
}

// cached counts f's pages in the page cache (mincore on a mapping of it,
// which faults nothing in).
func cached(f *os.File) (int64, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if st.Size() == 0 {
		return 0, nil
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("map the executable to count its cached pages: %w", err)
	}
	defer unix.Munmap(data)
	page := os.Getpagesize()
	vec := make([]byte, (len(data)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&data[0])), uintptr(len(data)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return 0, fmt.Errorf("mincore: %w", errno)
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return n * int64(page), nil
}

// fileRSS reads RssFile from /proc/self/status, in bytes.
func fileRSS() (int64, error) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "RssFile:"); ok {
			kib, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("RssFile in /proc/self/status: %q: %w", line, err)
			}
			return kib << 10, nil
		}
	}
	return 0, fmt.Errorf("no RssFile in /proc/self/status")
}

type mapping struct {
	start, end uintptr
	perms      string
	path       string
}

// parseMapping reads one line of /proc/self/maps:
// "start-end perms offset dev inode path".
func parseMapping(line string) (mapping, bool) {
	fields := strings.Fields(line)
	if len(fields) < 6 {
		return mapping{}, false
	}
	lo, hi, ok := strings.Cut(fields[0], "-")
	if !ok {
		return mapping{}, false
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil || end <= start {
		return mapping{}, false
	}
	return mapping{start: uintptr(start), end: uintptr(end), perms: fields[1], path: strings.Join(fields[5:], " ")}, true
}
