package release

import (
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// HostFiles copies files of this machine into image files as they are:
// every symlink on the way (a usrmerge /lib → usr/lib included) becomes a
// symlink in the image, and every ELF file brings its interpreter and the
// shared libraries it needs (DT_NEEDED, found in the multiarch and lib
// dirs like the dynamic loader does without a cache), recursively.
func HostFiles(paths ...string) ([]File, error) { return RootFiles("/", paths...) }

// RootFiles is HostFiles for the tree under root, as if root were / (an
// architecture's packages unpacked: hack/debian-root.sh): paths, symlink
// targets and libraries are looked up under root, and keep their paths
// below it in the image.
func RootFiles(root string, paths ...string) ([]File, error) {
	c := &hostCollector{root: root, files: map[string]File{}}
	for _, p := range paths {
		if err := c.add(p, 0); err != nil {
			return nil, err
		}
	}
	out := make([]File, 0, len(c.files))
	for _, f := range c.files {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

type hostCollector struct {
	root  string
	files map[string]File
}

// host is where the image path p is on this machine.
func (c *hostCollector) host(p string) string { return filepath.Join(c.root, p) }

// libDirs is where the loader looks when there is no ld.so.cache, in its
// order (Debian's multiarch dirs first).
var libDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"}

func (c *hostCollector) add(p string, depth int) error {
	if depth > 40 {
		return fmt.Errorf("release: too many symlinks at %s", p)
	}
	p = filepath.Clean(p)
	if _, done := c.files[p]; done {
		return nil
	}
	parts := strings.Split(strings.TrimPrefix(p, "/"), "/")
	cur := "/"
	for i, part := range parts {
		next := filepath.Join(cur, part)
		fi, err := os.Lstat(c.host(next))
		if err != nil {
			return fmt.Errorf("release: host file: %w", err)
		}
		switch {
		case fi.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink(c.host(next))
			if err != nil {
				return err
			}
			c.files[next] = File{Path: next, Link: target}
			resolved := target
			if !filepath.IsAbs(target) {
				resolved = filepath.Join(cur, target)
			}
			return c.add(filepath.Join(append([]string{resolved}, parts[i+1:]...)...), depth+1)
		case fi.IsDir():
			if i == len(parts)-1 {
				return fmt.Errorf("release: %s is a directory", next)
			}
			cur = next
		case fi.Mode().IsRegular():
			if i != len(parts)-1 {
				return fmt.Errorf("release: %s is not a directory", next)
			}
			data, err := os.ReadFile(c.host(next))
			if err != nil {
				return err
			}
			c.files[next] = File{Path: next, Mode: int64(fi.Mode().Perm()), Data: data}
			return c.addDeps(next, depth)
		default:
			return fmt.Errorf("release: %s: unsupported file type %s", next, fi.Mode())
		}
	}
	return nil
}

// addDeps adds what the ELF file p needs to run; other files need nothing.
func (c *hostCollector) addDeps(p string, depth int) error {
	f, err := elf.Open(c.host(p))
	if err != nil {
		return nil // not ELF
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		buf := make([]byte, prog.Filesz)
		if _, err := prog.ReadAt(buf, 0); err != nil {
			return fmt.Errorf("release: %s: interpreter: %w", p, err)
		}
		if err := c.add(strings.TrimRight(string(buf), "\x00"), depth+1); err != nil {
			return err
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return fmt.Errorf("release: %s: %w", p, err)
	}
	for _, lib := range libs {
		found := false
		for _, dir := range libDirs {
			if _, err := os.Stat(c.host(filepath.Join(dir, lib))); err == nil {
				if err := c.add(filepath.Join(dir, lib), depth+1); err != nil {
					return err
				}
				found = true
				break
			}
		}
		if !found {
			return fmt.Errorf("release: %s needs %s, not found in %v under %s", p, lib, libDirs, c.root)
		}
	}
	return nil
}
