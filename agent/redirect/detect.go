package redirect

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/google/nftables"

	"github.com/inpod-dev/inpod/netns"
)

// Detection is the backend a node appears to use, and why.
type Detection struct {
	// Backend is "nftables", "iptables-nft" or "iptables-legacy".
	Backend string
	Reason  string
}

// Detect reads the node netns' netfilter state and picks the backend that
// matches what the node's own networking (kube-proxy, the CNI) uses. It
// only reads: it never runs an iptables command that could create a table,
// because a created table would change what every later detection sees.
//
// iptables-nft tables are recognised over netlink by their built-in chain
// names (PREROUTING, POSTROUTING, …, upper case, as nft users never write
// them); legacy tables by the netns' /proc list of x_tables. With both,
// the one holding more rules wins; with neither, nftables.
func Detect(node *os.File) (Detection, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(node.Fd())))
	if err != nil {
		return Detection{}, fmt.Errorf("redirect: netlink in node netns: %w", err)
	}
	chains, err := c.ListChains()
	if err != nil {
		return Detection{}, fmt.Errorf("redirect: list node chains: %w", err)
	}
	nftIptablesRules, nativeTables := 0, map[string]bool{}
	for _, ch := range chains {
		fam := ch.Table.Family
		if (fam == nftables.TableFamilyIPv4 || fam == nftables.TableFamilyIPv6) && isIPTablesTable(ch.Table.Name) {
			rules, err := c.GetRules(ch.Table, ch)
			if err != nil {
				return Detection{}, fmt.Errorf("redirect: list rules of %s: %w", ch.Name, err)
			}
			nftIptablesRules += len(rules)
			continue
		}
		if ch.Table.Name != hostTableName {
			nativeTables[ch.Table.Name] = true
		}
	}
	legacyRules, legacyTables, err := countLegacyRules(node)
	if err != nil {
		return Detection{}, err
	}
	switch {
	case legacyTables && legacyRules > nftIptablesRules:
		return Detection{"iptables-legacy", fmt.Sprintf("node has %d iptables-legacy rules and %d iptables-nft rules", legacyRules, nftIptablesRules)}, nil
	case nftIptablesRules > 0:
		return Detection{"iptables-nft", fmt.Sprintf("node has %d iptables-nft rules and %d iptables-legacy rules", nftIptablesRules, legacyRules)}, nil
	case len(nativeTables) > 0:
		return Detection{"nftables", fmt.Sprintf("node uses native nftables tables (%d) and no iptables rules", len(nativeTables))}, nil
	default:
		return Detection{"nftables", "node has no netfilter rules; nftables needs no exec"}, nil
	}
}

func isIPTablesTable(name string) bool {
	switch name {
	case "filter", "nat", "mangle", "raw", "security":
		return true
	}
	return false
}

// countLegacyRules counts x_tables rules in the node netns. iptables-legacy
// -save dumps only tables that already exist, so it creates nothing.
func countLegacyRules(node *os.File) (rules int, anyTable bool, err error) {
	err = netns.Do(node, func() error {
		for _, pair := range [][2]string{{"ip_tables_names", "iptables-legacy-save"}, {"ip6_tables_names", "ip6tables-legacy-save"}} {
			names, err := os.ReadFile("/proc/thread-self/net/" + pair[0])
			if errors.Is(err, os.ErrNotExist) || len(bytes.TrimSpace(names)) == 0 {
				continue
			}
			if err != nil {
				return err
			}
			anyTable = true
			out, err := exec.Command(pair[1]).Output()
			if err != nil {
				return fmt.Errorf("%s: %w", pair[1], err)
			}
			rules += strings.Count(string(out), "\n-A ")
		}
		return nil
	})
	if err != nil {
		return 0, false, fmt.Errorf("redirect: read legacy iptables state: %w", err)
	}
	return rules, anyTable, nil
}

// NewBackend builds a backend by name: "nftables", "iptables-nft",
// "iptables-legacy", or "auto" for Detect's choice on the node netns.
func NewBackend(name string, node *os.File) (Backend, Detection, error) {
	det := Detection{Backend: name, Reason: "chosen explicitly"}
	if name == "auto" {
		var err error
		if det, err = Detect(node); err != nil {
			return nil, det, err
		}
	}
	switch det.Backend {
	case "nftables":
		return NewNFTables(), det, nil
	case "iptables-nft":
		b, err := NewIPTables(IPTablesNFT)
		return b, det, err
	case "iptables-legacy":
		b, err := NewIPTables(IPTablesLegacy)
		return b, det, err
	}
	return nil, det, fmt.Errorf("redirect: unknown backend %q (want auto, nftables, iptables-nft or iptables-legacy)", name)
}
