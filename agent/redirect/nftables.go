package redirect

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// nftTableName is inpod's table in the pod netns (family inet: both IP
// versions in one table, one transaction).
const nftTableName = "inpod"

// NFTables applies the rules as one nf_tables netlink batch: no exec, and
// the whole table is swapped in a single kernel transaction.
type NFTables struct{}

// NewNFTables returns the nftables backend.
func NewNFTables() *NFTables { return &NFTables{} }

func (*NFTables) Name() string { return "nftables" }

type nftChain struct {
	chain *nftables.Chain
	rules [][]expr.Any
}

func nftTable() *nftables.Table {
	return &nftables.Table{Name: nftTableName, Family: nftables.TableFamilyINet}
}

// nftRules builds the in-pod rule set: the same behaviour as the iptables
// rule set, rule for rule, in nf_tables expressions.
func nftRules(opts Options, fams []Family) []nftChain {
	t := nftTable()
	chain := func(name string, typ nftables.ChainType, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
		return &nftables.Chain{Name: name, Table: t, Type: typ, Hooknum: hook, Priority: prio}
	}
	ipv4, ipv6 := slices.Contains(fams, IPv4), slices.Contains(fams, IPv6)
	perFamily := func(build func(f Family) []expr.Any) [][]expr.Any {
		var out [][]expr.Any
		if ipv4 {
			out = append(out, build(IPv4))
		}
		if ipv6 {
			out = append(out, build(IPv6))
		}
		return out
	}

	mangleOut := nftChain{chain: chain("mangle_output", nftables.ChainTypeRoute, nftables.ChainHookOutput, nftables.ChainPriorityMangle),
		rules: [][]expr.Any{cat(
			ctMarkMasked(expr.CmpOpEq, ConnMark),
			// Restore the connection's mark onto the reply so it follows
			// table 100 back to ztunnel (route chain: rerouted on change).
			[]expr.Any{
				&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
				bitwise(^uint32(MarkMask), ConnMark),
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
			})}}
	manglePre := nftChain{chain: chain("mangle_prerouting", nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityMangle),
		rules: [][]expr.Any{cat(
			markMasked(expr.CmpOpEq, ZtunnelMark),
			[]expr.Any{
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
				bitwise(^uint32(MarkMask), ConnMark),
				&expr.Ct{Key: expr.CtKeyMARK, SourceRegister: true, Register: 1},
			})}}

	natPre := nftChain{chain: chain("nat_prerouting", nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest)}
	for _, name := range opts.VirtualInterfaces {
		natPre.rules = append(natPre.rules,
			cat(iif(expr.CmpOpEq, name), l4(unix.IPPROTO_TCP), redirect(PortOutbound)),
			cat(iif(expr.CmpOpEq, name), l4(unix.IPPROTO_TCP), []expr.Any{&expr.Verdict{Kind: expr.VerdictReturn}}))
	}
	natPre.rules = append(natPre.rules, perFamily(func(f Family) []expr.Any {
		return cat(l4(unix.IPPROTO_TCP), addr(f, source, expr.CmpOpEq, f.probeSource().AsSlice()), accept())
	})...)
	if !opts.NoInboundCapture {
		natPre.rules = append(natPre.rules, perFamily(func(f Family) []expr.Any {
			return cat(l4(unix.IPPROTO_TCP), addr(f, destination, expr.CmpOpNeq, f.loopback().AsSlice()),
				port(destination, expr.CmpOpNeq, PortHBONE), markMasked(expr.CmpOpNeq, ZtunnelMark), redirect(PortInbound))
		})...)
	}

	natOut := nftChain{chain: chain("nat_output", nftables.ChainTypeNAT, nftables.ChainHookOutput, nftables.ChainPriorityNATDest)}
	natOut.rules = perFamily(func(f Family) []expr.Any {
		return cat(l4(unix.IPPROTO_TCP), addr(f, destination, expr.CmpOpEq, f.probeSource().AsSlice()), accept())
	})
	if opts.DNSCapture {
		natOut.rules = append(natOut.rules, cat(oif(expr.CmpOpNeq, "lo"), l4(unix.IPPROTO_UDP),
			markMasked(expr.CmpOpNeq, ZtunnelMark), port(destination, expr.CmpOpEq, 53), redirect(PortDNS)))
		natOut.rules = append(natOut.rules, perFamily(func(f Family) []expr.Any {
			return cat(l4(unix.IPPROTO_TCP), addr(f, destination, expr.CmpOpNeq, f.loopback().AsSlice()),
				port(destination, expr.CmpOpEq, 53), markMasked(expr.CmpOpNeq, ZtunnelMark), redirect(PortDNS))
		})...)
	}
	natOut.rules = append(natOut.rules, cat(l4(unix.IPPROTO_TCP), markMasked(expr.CmpOpEq, ConnMark), accept()))
	natOut.rules = append(natOut.rules, perFamily(func(f Family) []expr.Any {
		return cat(addr(f, destination, expr.CmpOpNeq, f.loopback().AsSlice()), oif(expr.CmpOpEq, "lo"), accept())
	})...)
	natOut.rules = append(natOut.rules, perFamily(func(f Family) []expr.Any {
		return cat(l4(unix.IPPROTO_TCP), addr(f, destination, expr.CmpOpNeq, f.loopback().AsSlice()),
			markMasked(expr.CmpOpNeq, ZtunnelMark), redirect(PortOutbound))
	})...)

	chains := []nftChain{manglePre, mangleOut, natPre, natOut}
	if opts.DNSCapture {
		zone := []expr.Any{
			&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(1)},
			&expr.Ct{Key: expr.CtKeyZONE, SourceRegister: true, Register: 1},
		}
		// A guest's own queries share the zone of their answers, as in
		// the iptables rule set.
		var rawPre [][]expr.Any
		for _, name := range opts.VirtualInterfaces {
			rawPre = append(rawPre, cat(iif(expr.CmpOpEq, name), l4(unix.IPPROTO_UDP), port(destination, expr.CmpOpEq, 53), zone))
		}
		rawPre = append(rawPre, cat(l4(unix.IPPROTO_UDP), markMasked(expr.CmpOpNeq, ZtunnelMark), port(source, expr.CmpOpEq, 53), zone))
		chains = append(chains,
			nftChain{chain: chain("raw_prerouting", nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityRaw),
				rules: rawPre},
			nftChain{chain: chain("raw_output", nftables.ChainTypeFilter, nftables.ChainHookOutput, nftables.ChainPriorityRaw),
				rules: [][]expr.Any{cat(l4(unix.IPPROTO_UDP), markMasked(expr.CmpOpEq, ZtunnelMark), port(destination, expr.CmpOpEq, 53), zone)}},
		)
	}
	return chains
}

func cat(parts ...[]expr.Any) []expr.Any { return slices.Concat(parts...) }

func bitwise(mask, xor uint32) *expr.Bitwise {
	return &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
		Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: binaryutil.NativeEndian.PutUint32(xor)}
}

func markMasked(op expr.CmpOp, value uint32) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		bitwise(MarkMask, 0),
		&expr.Cmp{Op: op, Register: 1, Data: binaryutil.NativeEndian.PutUint32(value)},
	}
}

func ctMarkMasked(op expr.CmpOp, value uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		bitwise(MarkMask, 0),
		&expr.Cmp{Op: op, Register: 1, Data: binaryutil.NativeEndian.PutUint32(value)},
	}
}

func nfproto(f Family) []expr.Any {
	proto := byte(unix.NFPROTO_IPV4)
	if f == IPv6 {
		proto = unix.NFPROTO_IPV6
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

func l4(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// side is which end of the packet a match reads.
type side int

const (
	source side = iota
	destination
)

// addr matches the packet's source or destination address; in an inet
// table the family is checked first so the offset means what it should.
func addr(f Family, end side, op expr.CmpOp, ip []byte) []expr.Any {
	offset, size := uint32(12), uint32(4) // IPv4 saddr
	if f == IPv6 {
		offset, size = 8, 16
	}
	if end == destination {
		offset += size
	}
	return cat(nfproto(f), []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: size},
		&expr.Cmp{Op: op, Register: 1, Data: ip},
	})
}

// port matches the transport header's source or destination port (TCP and
// UDP share the layout).
func port(end side, op expr.CmpOp, p uint16) []expr.Any {
	offset := uint32(0) // sport
	if end == destination {
		offset = 2
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: offset, Len: 2},
		&expr.Cmp{Op: op, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

func oif(op expr.CmpOp, name string) []expr.Any { return ifname(expr.MetaKeyOIFNAME, op, name) }

func iif(op expr.CmpOp, name string) []expr.Any { return ifname(expr.MetaKeyIIFNAME, op, name) }

func ifname(key expr.MetaKey, op expr.CmpOp, name string) []expr.Any {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: b},
	}
}

func redirect(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
		// The form the kernel reports back (max = min, range specified),
		// so that verification compares like with like.
		&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
	}
}

func accept() []expr.Any { return []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}} }

// nftConn opens one netlink socket in ns for all of an operation's
// requests: without it the library opens one per request, and each open
// moves a locked OS thread into the pod netns and back. Pod-netns
// operations run by the hundred in a burst of pod starts, where those
// switches and the sockets' buffers were most of the rule apply's cost.
// The caller must call the returned close.
func nftConn(ns *os.File) (*nftables.Conn, func(), error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())), nftables.AsLasting())
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	return c, func() { _ = c.CloseLasting() }, nil
}

// Apply leaves an intact table alone; otherwise it deletes whatever inpod
// table is there and writes the wanted one in the same batch, so the pod
// never sees a half-applied set.
func (n *NFTables) Apply(ns *os.File, opts Options, fams []Family) (bool, error) {
	c, done, err := nftConn(ns)
	if err != nil {
		return false, err
	}
	defer done()
	want := nftRules(opts, fams)
	present, err := tableExists(c)
	if err != nil {
		return false, err
	}
	if present {
		intact, err := matchesKernelTable(c, nftTableName, want)
		if err != nil {
			return false, err
		}
		if intact {
			return false, nil
		}
		c.DelTable(nftTable())
	}
	t := c.AddTable(nftTable())
	for _, ch := range want {
		ch.chain.Table = t
		c.AddChain(ch.chain)
		for _, r := range ch.rules {
			c.AddRule(&nftables.Rule{Table: t, Chain: ch.chain, Exprs: r})
		}
	}
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("apply nftables batch: %w", err)
	}
	return true, nil
}

func (n *NFTables) Remove(ns *os.File) (bool, error) {
	c, done, err := nftConn(ns)
	if err != nil {
		return false, err
	}
	defer done()
	present, err := tableExists(c)
	if err != nil || !present {
		return false, err
	}
	c.DelTable(nftTable())
	if err := c.Flush(); err != nil {
		return false, fmt.Errorf("delete nftables table: %w", err)
	}
	return true, nil
}

func (n *NFTables) Present(ns *os.File) (bool, error) {
	c, done, err := nftConn(ns)
	if err != nil {
		return false, err
	}
	defer done()
	return tableExists(c)
}

func tableExists(c *nftables.Conn) (bool, error) {
	_, err := c.ListTableOfFamily(nftTableName, nftables.TableFamilyINet)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	return false, fmt.Errorf("look up nftables table: %w", err)
}

// matchesKernelTable compares an inet table in the kernel with want: the
// same chains (name, type, hook, priority) and, in each, the same rules
// expression by expression (compared in their netlink encoding).
func matchesKernelTable(c *nftables.Conn, table string, want []nftChain) (bool, error) {
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("list nftables chains: %w", err)
	}
	got := map[string]*nftables.Chain{}
	for _, ch := range chains {
		if ch.Table.Name == table {
			got[ch.Name] = ch
		}
	}
	if len(got) != len(want) {
		return false, nil
	}
	for _, w := range want {
		k, ok := got[w.chain.Name]
		if !ok || k.Type != w.chain.Type || !sameHook(k, w.chain) {
			return false, nil
		}
		rules, err := c.GetRules(k.Table, k)
		if err != nil {
			return false, fmt.Errorf("list rules of %s: %w", k.Name, err)
		}
		if len(rules) != len(w.rules) {
			return false, nil
		}
		for i, r := range rules {
			if !sameExprs(r.Exprs, w.rules[i]) {
				return false, nil
			}
		}
	}
	return true, nil
}

func sameHook(a, b *nftables.Chain) bool {
	return a.Hooknum != nil && b.Hooknum != nil && *a.Hooknum == *b.Hooknum &&
		a.Priority != nil && b.Priority != nil && *a.Priority == *b.Priority
}

func sameExprs(got, want []expr.Any) bool {
	if len(got) != len(want) {
		return false
	}
	fam := byte(nftables.TableFamilyINet)
	for i := range got {
		g, err1 := expr.Marshal(fam, comparable(got[i]))
		w, err2 := expr.Marshal(fam, comparable(want[i]))
		if err1 != nil || err2 != nil || !bytes.Equal(g, w) {
			return false
		}
	}
	return true
}

// comparable drops what the library cannot read back: for a "ct ... set"
// expression it decodes no source register (inpod always uses register 1,
// loaded by the expression before it, which is compared).
func comparable(e expr.Any) expr.Any {
	if ct, ok := e.(*expr.Ct); ok && (ct.SourceRegister || ct.Register == 0) {
		return &expr.Ct{Key: ct.Key, Direction: ct.Direction}
	}
	return e
}
