package release

import (
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
)

// HostFiles copies files of this machine into image files as they are:
// every symlink on the way (a usrmerge /lib → usr/lib included) becomes a
// symlink in the image, and every ELF file brings its interpreter and the
// shared libraries it needs (DT_NEEDED, found in the multiarch and lib
// dirs like the dynamic loader does without a cache), recursively.
func HostFiles(paths ...string) ([]File, error) { return RootFiles("/", runtime.GOARCH, paths...) }

// RootFiles is HostFiles for the tree under root, as if root were / (the
// packages of architecture arch unpacked: hack/debian-root.sh): paths,
// symlink targets and libraries are looked up under root, and keep their
// paths below it in the image. Libraries are looked up in arch's multiarch
// dirs only, and one built for another machine is passed over as the
// loader passes it over, so a multiarch machine's other libraries never
// reach the image.
func RootFiles(root, arch string, paths ...string) ([]File, error) {
	triplet, machine := Triplet(arch), elfMachines[arch]
	if triplet == "" {
		return nil, fmt.Errorf("release: no Debian multiarch triplet known for %q", arch)
	}
	c := &hostCollector{root: root, machine: machine, files: map[string]File{},
		libDirs: []string{"/lib/" + triplet, "/usr/lib/" + triplet, "/lib64", "/usr/lib64", "/lib", "/usr/lib"}}
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

// Triplet is Debian's multiarch triplet of a Go architecture (the lib dir
// name, x86_64-linux-gnu), or "" for one inpod does not build.
func Triplet(arch string) string {
	return map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[arch]
}

var elfMachines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

type hostCollector struct {
	root    string
	machine elf.Machine
	// libDirs is where the loader looks when there is no ld.so.cache, in
	// its order (the architecture's multiarch dirs first).
	libDirs []string
	files   map[string]File
}

// host is where the image path p is on this machine.
func (c *hostCollector) host(p string) string { return filepath.Join(c.root, p) }

// resolve is where the image path p ends on this machine, its symlinks
// followed under root as they would be in the image; ok is false when it
// does not exist there.
func (c *hostCollector) resolve(p string) (string, bool) {
	for range 40 {
		parts := strings.Split(strings.TrimPrefix(filepath.Clean(p), "/"), "/")
		cur, next := "/", ""
		for i, part := range parts {
			cur = filepath.Join(cur, part)
			fi, err := os.Lstat(c.host(cur))
			if err != nil {
				return "", false
			}
			if fi.Mode()&os.ModeSymlink != 0 {
				target, err := os.Readlink(c.host(cur))
				if err != nil {
					return "", false
				}
				if !filepath.IsAbs(target) {
					target = filepath.Join(filepath.Dir(cur), target)
				}
				next = filepath.Join(append([]string{target}, parts[i+1:]...)...)
				break
			}
		}
		if next == "" {
			return c.host(cur), true
		}
		p = next
	}
	return "", false
}

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

// isLibrary reports whether the image path p is an ELF file for the
// collector's machine.
func (c *hostCollector) isLibrary(p string) bool {
	at, ok := c.resolve(p)
	if !ok {
		return false
	}
	f, err := elf.Open(at)
	if err != nil {
		return false
	}
	defer f.Close()
	return f.Machine == c.machine
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
		for _, dir := range c.libDirs {
			if !c.isLibrary(filepath.Join(dir, lib)) {
				continue
			}
			if err := c.add(filepath.Join(dir, lib), depth+1); err != nil {
				return err
			}
			found = true
			break
		}
		if !found {
			return fmt.Errorf("release: %s needs %s, not found for %s in %v under %s", p, lib, c.machine, c.libDirs, c.root)
		}
	}
	return nil
}
