package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Generation reads the nf_tables generation of the netns ns: a counter the
// kernel moves on every committed change to any nf_tables table there,
// iptables-nft's included. While it has not moved since a rule set was
// proven intact, that set is still intact, so a verifier can skip reading
// the whole set back (one netlink round trip instead of a dozen, and no
// iptables-save for the iptables-nft backend). It says nothing about
// iptables-legacy's tables or the policy routing.
func Generation(ns *os.File) (uint32, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		return 0, fmt.Errorf("redirect: netfilter netlink in the pod netns: %w", err)
	}
	defer c.Close()
	// nfgenmsg: family, version, resource id.
	req := netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		Data:   []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return 0, fmt.Errorf("redirect: read the nf_tables generation: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return ad.Uint32(), nil
			}
		}
		if err := ad.Err(); err != nil {
			return 0, err
		}
	}
	return 0, errors.New("redirect: the kernel sent no nf_tables generation")
}
