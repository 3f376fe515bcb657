package redirect

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/google/nftables"

	"github.com/inpod-dev/inpod/netns"
)

// IPTablesMode selects which iptables implementation writes the rules.
type IPTablesMode string

const (
	// IPTablesNFT uses the iptables-nft binaries (rules live in nf_tables).
	IPTablesNFT IPTablesMode = "nft"
	// IPTablesLegacy uses the iptables-legacy binaries (x_tables).
	IPTablesLegacy IPTablesMode = "legacy"
)

// IPTables applies the rules with one iptables-restore per family.
type IPTables struct {
	mode IPTablesMode
	bins map[Family]iptBinaries
}

type iptBinaries struct{ restore, save string }

// NewIPTables finds the binaries of the given mode and fails clearly when
// they are not installed.
func NewIPTables(mode IPTablesMode) (*IPTables, error) {
	if mode != IPTablesNFT && mode != IPTablesLegacy {
		return nil, fmt.Errorf("redirect: unknown iptables mode %q (want nft or legacy)", mode)
	}
	b := &IPTables{mode: mode, bins: map[Family]iptBinaries{}}
	for f, cmd := range map[Family]string{IPv4: "iptables", IPv6: "ip6tables"} {
		var bins iptBinaries
		for _, x := range []struct {
			dst  *string
			name string
		}{{&bins.restore, cmd + "-" + string(mode) + "-restore"}, {&bins.save, cmd + "-" + string(mode) + "-save"}} {
			path, err := exec.LookPath(x.name)
			if err != nil {
				return nil, fmt.Errorf("redirect: iptables %s mode needs %s: %w", mode, x.name, err)
			}
			*x.dst = path
		}
		b.bins[f] = bins
	}
	return b, nil
}

func (b *IPTables) Name() string { return "iptables-" + string(b.mode) }

// Apply restores the rule set per family. When a cheap look-up shows no
// inpod chain, the restore runs straight away; otherwise iptables-save tells
// whether the rules are intact (nothing written) or must be replaced (one
// restore that swaps the old set for the new atomically).
func (b *IPTables) Apply(ns *os.File, opts Options, families []Family) (bool, error) {
	changed := false
	presentIn, err := b.presentByFamily(ns)
	if err != nil {
		return false, err
	}
	for _, f := range []Family{IPv4, IPv6} {
		want := iptablesRules(f, opts)
		present := presentIn[f]
		var input string
		switch {
		case !slices.Contains(families, f) && !present:
			continue
		case !slices.Contains(families, f):
			// The family is off in the pod now; leave nothing behind.
			saved, err := b.save(ns, f)
			if err != nil {
				return changed, err
			}
			input = removeInput(saved)
		case !present:
			input = want.restoreInput()
		default:
			saved, err := b.save(ns, f)
			if err != nil {
				return changed, err
			}
			if want.matches(saved) {
				continue
			}
			input = want.replaceInput(saved)
		}
		if err := b.restore(ns, f, input); err != nil {
			return changed, err
		}
		changed = true
	}
	return changed, nil
}

func (b *IPTables) Remove(ns *os.File) (bool, error) {
	presentIn, err := b.presentByFamily(ns)
	if err != nil {
		return false, err
	}
	changed := false
	for _, f := range []Family{IPv4, IPv6} {
		if !presentIn[f] {
			continue
		}
		saved, err := b.save(ns, f)
		if err != nil {
			return changed, err
		}
		if err := b.restore(ns, f, removeInput(saved)); err != nil {
			return changed, err
		}
		changed = true
		if b.mode == IPTablesNFT {
			if err := dropEmptyTables(ns, f); err != nil {
				return changed, err
			}
		}
	}
	return changed, nil
}

// dropEmptyTables deletes the tables iptables-nft created for inpod once they
// hold nothing but empty built-in chains, so Remove leaves the netns as it
// found it. Legacy tables cannot be deleted; they stay, empty.
func dropEmptyTables(ns *os.File, f Family) error {
	conn, done, err := nftConn(ns)
	if err != nil {
		return fmt.Errorf("redirect: %w", err)
	}
	defer done()
	family := nftables.TableFamilyIPv4
	if f == IPv6 {
		family = nftables.TableFamilyIPv6
	}
	chains, err := conn.ListChainsOfTableFamily(family)
	if err != nil {
		return fmt.Errorf("redirect: list %s chains: %w", f, err)
	}
	byTable := map[string][]*nftables.Chain{}
	for _, c := range chains {
		byTable[c.Table.Name] = append(byTable[c.Table.Name], c)
	}
	for _, name := range []string{"mangle", "nat", "raw"} {
		cs, ok := byTable[name]
		if !ok {
			continue
		}
		empty := true
		for _, c := range cs {
			rules, err := conn.GetRules(c.Table, c)
			if err != nil {
				return fmt.Errorf("redirect: list rules of %s %s: %w", name, c.Name, err)
			}
			if c.Hooknum == nil || len(rules) > 0 || (c.Policy != nil && *c.Policy != nftables.ChainPolicyAccept) {
				empty = false
				break
			}
		}
		if empty {
			conn.DelTable(cs[0].Table)
		}
	}
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("redirect: delete empty %s tables: %w", f, err)
	}
	return nil
}

func (b *IPTables) Present(ns *os.File) (bool, error) {
	present, err := b.presentByFamily(ns)
	return present[IPv4] || present[IPv6], err
}

// presentByFamily answers "are inpod chains here?" per family as cheaply as
// it can, since the agent asks it of every pod: iptables-nft keeps its
// chains in nf_tables, readable over netlink without exec (both families in
// one request); legacy tables show in the netns' procfs once created, and
// only when some exist does iptables-save have to look inside. A fresh pod
// netns has neither, so its first Apply costs exactly one restore per
// family.
func (b *IPTables) presentByFamily(ns *os.File) (map[Family]bool, error) {
	if b.mode == IPTablesLegacy {
		return b.presentLegacy(ns)
	}
	return presentNFT(ns)
}

// legacyTableLists are the procfs files that list a netns' legacy tables,
// per family.
var legacyTableLists = [...]struct {
	family Family
	file   string
}{{IPv4, "ip_tables_names"}, {IPv6, "ip6_tables_names"}}

func (b *IPTables) presentLegacy(ns *os.File) (map[Family]bool, error) {
	var tables [len(legacyTableLists)][]byte
	err := netns.Do(ns, func() error {
		for i, l := range legacyTableLists {
			var err error
			tables[i], err = os.ReadFile("/proc/thread-self/net/" + l.file)
			if err != nil && !errors.Is(err, os.ErrNotExist) { // absent: module not loaded, no legacy table anywhere
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("redirect: read legacy table list: %w", err)
	}
	present := map[Family]bool{}
	for i, l := range legacyTableLists {
		if len(bytes.TrimSpace(tables[i])) == 0 {
			continue
		}
		// Legacy tables cannot be deleted once created, so their existence
		// says little; only here does the look-up need an exec.
		saved, err := b.save(ns, l.family)
		if err != nil {
			return nil, err
		}
		present[l.family] = len(saved.tablesWithInpodChains()) > 0
	}
	return present, nil
}

func presentNFT(ns *os.File) (map[Family]bool, error) {
	conn, done, err := nftConn(ns)
	if err != nil {
		return nil, fmt.Errorf("redirect: %w", err)
	}
	defer done()
	chains, err := conn.ListChains()
	if err != nil {
		return nil, fmt.Errorf("redirect: list chains: %w", err)
	}
	present := map[Family]bool{}
	for _, c := range chains {
		if !strings.HasPrefix(c.Name, chainPrefix) {
			continue
		}
		switch c.Table.Family {
		case nftables.TableFamilyIPv4:
			present[IPv4] = true
		case nftables.TableFamilyIPv6:
			present[IPv6] = true
		}
	}
	return present, nil
}

func (b *IPTables) save(ns *os.File, f Family) (savedRules, error) {
	out, err := b.run(ns, b.bins[f].save, nil)
	if err != nil {
		return nil, err
	}
	return parseSave(out)
}

func (b *IPTables) restore(ns *os.File, f Family, input string) error {
	_, err := b.run(ns, b.bins[f].restore, []byte(input), "--noflush", "--wait")
	if err != nil {
		return fmt.Errorf("%w\ninput was:\n%s", err, input)
	}
	return nil
}

// run execs bin inside ns: the child inherits the namespace of the locked
// thread that forks it.
func (b *IPTables) run(ns *os.File, bin string, stdin []byte, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	err := netns.Do(ns, func() error {
		cmd := exec.Command(bin, args...)
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		return cmd.Run()
	})
	if err != nil {
		return "", fmt.Errorf("redirect: %s %s: %w: %s", bin, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}
