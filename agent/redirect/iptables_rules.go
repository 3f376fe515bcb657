package redirect

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Chain names inpod owns in each table. The prefix identifies inpod's
// chains when verifying or removing.
const (
	chainPrefix = "INPOD_"
	chainPrert  = "INPOD_PRERT"
	chainOutput = "INPOD_OUTPUT"
)

// ipt* describe a rule set in iptables-save's canonical form, so that what
// iptables-save prints can be compared line by line with what was meant.
type iptRuleSet struct {
	family Family
	tables []iptTable
}

type iptTable struct {
	name   string
	chains []iptChain
}

type iptChain struct {
	name   string
	parent string // the built-in chain that jumps here
	rules  []string
}

// iptablesRules renders the in-pod rule set for one family.
func iptablesRules(f Family, o Options) iptRuleSet {
	lo := prefix(f.loopback())
	probe := prefix(f.probeSource())
	notZtunnel := fmt.Sprintf("-m mark ! --mark %#x/%#x", ZtunnelMark, MarkMask)

	mangle := iptTable{name: "mangle", chains: []iptChain{
		{name: chainPrert, parent: "PREROUTING", rules: []string{
			fmt.Sprintf("-m mark --mark %#x/%#x -j CONNMARK --set-xmark %#x/%#x", ZtunnelMark, MarkMask, ConnMark, MarkMask),
		}},
		{name: chainOutput, parent: "OUTPUT", rules: []string{
			fmt.Sprintf("-m connmark --mark %#x/%#x -j CONNMARK --restore-mark --nfmask %#x --ctmask %#x", ConnMark, MarkMask, MarkMask, MarkMask),
		}},
	}}

	// A virtual interface's TCP first: it is a guest's outbound traffic,
	// and no inbound rule may see it.
	var prert []string
	for _, name := range o.VirtualInterfaces {
		prert = append(prert,
			fmt.Sprintf("-i %s -p tcp -j REDIRECT --to-ports %d", name, PortOutbound),
			fmt.Sprintf("-i %s -p tcp -j RETURN", name))
	}
	prert = append(prert, fmt.Sprintf("-s %s -p tcp -j ACCEPT", probe))
	if !o.NoInboundCapture {
		prert = append(prert, fmt.Sprintf("! -d %s -p tcp -m tcp ! --dport %d %s -j REDIRECT --to-ports %d", lo, PortHBONE, notZtunnel, PortInbound))
	}
	output := []string{fmt.Sprintf("-d %s -p tcp -j ACCEPT", probe)}
	if o.DNSCapture {
		output = append(output,
			fmt.Sprintf("! -o lo -p udp %s -m udp --dport 53 -j REDIRECT --to-ports %d", notZtunnel, PortDNS),
			fmt.Sprintf("! -d %s -p tcp -m tcp --dport 53 %s -j REDIRECT --to-ports %d", lo, notZtunnel, PortDNS),
		)
	}
	output = append(output,
		fmt.Sprintf("-p tcp -m mark --mark %#x/%#x -j ACCEPT", ConnMark, MarkMask),
		fmt.Sprintf("! -d %s -o lo -j ACCEPT", lo),
		fmt.Sprintf("! -d %s -p tcp %s -j REDIRECT --to-ports %d", lo, notZtunnel, PortOutbound),
	)
	nat := iptTable{name: "nat", chains: []iptChain{
		{name: chainPrert, parent: "PREROUTING", rules: prert},
		{name: chainOutput, parent: "OUTPUT", rules: output},
	}}

	rs := iptRuleSet{family: f, tables: []iptTable{mangle, nat}}
	if o.DNSCapture {
		// DNS answers ztunnel relays must not be matched to the pod's own
		// conntrack entries for its original queries.
		// A guest's own queries (a virtual interface's, forwarded by the
		// pod) go to that zone too: their answers come in from port 53
		// like the relayed ones, and must find the query's entry to be
		// un-NATed back to the guest.
		var rawPrert []string
		for _, name := range o.VirtualInterfaces {
			rawPrert = append(rawPrert, fmt.Sprintf("-i %s -p udp -m udp --dport 53 -j CT --zone 1", name))
		}
		rawPrert = append(rawPrert, fmt.Sprintf("-p udp %s -m udp --sport 53 -j CT --zone 1", notZtunnel))
		rs.tables = append(rs.tables, iptTable{name: "raw", chains: []iptChain{
			{name: chainPrert, parent: "PREROUTING", rules: rawPrert},
			{name: chainOutput, parent: "OUTPUT", rules: []string{
				fmt.Sprintf("-p udp -m mark --mark %#x/%#x -m udp --dport 53 -j CT --zone 1", ZtunnelMark, MarkMask),
			}},
		}})
	}
	return rs
}

func prefix(a netip.Addr) string {
	return fmt.Sprintf("%s/%d", a.String(), a.BitLen())
}

// restoreInput is the iptables-restore --noflush input that installs rs
// into a netns holding none of inpod's chains.
func (rs iptRuleSet) restoreInput() string {
	return rs.replaceInput(savedRules{})
}

// replaceInput turns what is there (saved) into rs in one transaction per
// table: each wanted chain is declared (which flushes it under --noflush)
// and refilled, every existing jump to an inpod chain is deleted by its
// exact saved spec and the wanted jumps added once, and inpod chains that
// are no longer wanted are emptied and deleted.
func (rs iptRuleSet) replaceInput(saved savedRules) string {
	var b strings.Builder
	wanted := map[string]iptTable{}
	var tables []string
	for _, t := range rs.tables {
		wanted[t.name] = t
		tables = append(tables, t.name)
	}
	for _, t := range saved.tablesWithInpodChains() {
		if _, ok := wanted[t]; !ok {
			tables = append(tables, t)
		}
	}
	for _, table := range tables {
		t := wanted[table]
		fmt.Fprintf(&b, "*%s\n", table)
		for _, c := range t.chains {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c.name)
		}
		for _, jump := range saved.jumpsToInpod(table) {
			fmt.Fprintf(&b, "-D %s\n", jump)
		}
		for _, stale := range saved.inpodChains(table) {
			if !slices.ContainsFunc(t.chains, func(c iptChain) bool { return c.name == stale }) {
				fmt.Fprintf(&b, "-F %s\n-X %s\n", stale, stale)
			}
		}
		for _, c := range t.chains {
			fmt.Fprintf(&b, "-A %s -j %s\n", c.parent, c.name)
		}
		for _, c := range t.chains {
			for _, r := range c.rules {
				fmt.Fprintf(&b, "-A %s %s\n", c.name, r)
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// removeInput deletes every inpod chain and jump found in saved.
func removeInput(saved savedRules) string {
	return iptRuleSet{}.replaceInput(saved)
}

// matches reports whether saved holds exactly rs: every wanted chain with
// exactly its rules, one jump to it from its parent, and no other inpod
// chain or jump.
func (rs iptRuleSet) matches(saved savedRules) bool {
	want := map[string]map[string][]string{}
	for _, t := range rs.tables {
		want[t.name] = map[string][]string{}
		for _, c := range t.chains {
			want[t.name][c.name] = c.rules
			want[t.name][c.parent] = append(want[t.name][c.parent], "-j "+c.name)
		}
	}
	for table, chains := range saved {
		for chain, rules := range chains {
			mine := rules
			if !strings.HasPrefix(chain, chainPrefix) {
				mine = nil
				for _, r := range rules {
					if isJumpToInpod(r) {
						mine = append(mine, r)
					}
				}
			}
			if !slices.Equal(mine, want[table][chain]) {
				return false
			}
		}
	}
	for table, chains := range want {
		for chain := range chains {
			if _, ok := saved[table][chain]; !ok {
				return false
			}
		}
	}
	return true
}

func isJumpToInpod(rule string) bool {
	return strings.Contains(rule, "-j "+chainPrefix) || strings.Contains(rule, "-g "+chainPrefix)
}

// savedRules is iptables-save output: table → chain → rule specs (without
// the "-A chain" prefix). Every declared chain has an entry, empty or not.
type savedRules map[string]map[string][]string

func parseSave(out string) (savedRules, error) {
	saved := savedRules{}
	var table string
	for n, line := range strings.Split(out, "\n") {
		switch {
		case line == "" || strings.HasPrefix(line, "#") || line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			saved[table] = map[string][]string{}
		case table == "":
			return nil, fmt.Errorf("iptables-save line %d outside a table: %q", n+1, line)
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if _, ok := saved[table][name]; !ok {
				saved[table][name] = nil
			}
		case strings.HasPrefix(line, "-A "):
			chain, spec, _ := strings.Cut(line[3:], " ")
			saved[table][chain] = append(saved[table][chain], spec)
		default:
			return nil, fmt.Errorf("iptables-save line %d not understood: %q", n+1, line)
		}
	}
	return saved, nil
}

func (s savedRules) inpodChains(table string) []string {
	var out []string
	for chain := range s[table] {
		if strings.HasPrefix(chain, chainPrefix) {
			out = append(out, chain)
		}
	}
	slices.Sort(out)
	return out
}

func (s savedRules) tablesWithInpodChains() []string {
	var out []string
	for table := range s {
		if len(s.inpodChains(table)) > 0 || len(s.jumpsToInpod(table)) > 0 {
			out = append(out, table)
		}
	}
	slices.Sort(out)
	return out
}

// jumpsToInpod lists "chain spec" for every rule outside inpod's chains
// that jumps into one, in a stable order.
func (s savedRules) jumpsToInpod(table string) []string {
	var out []string
	for chain, rules := range s[table] {
		if strings.HasPrefix(chain, chainPrefix) {
			continue
		}
		for _, r := range rules {
			if isJumpToInpod(r) {
				out = append(out, chain+" "+r)
			}
		}
	}
	slices.Sort(out)
	return out
}
