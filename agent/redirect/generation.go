package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/inpod-dev/inpod/netns"
)

// Generation reads the nf_tables generation of the netns ns: a counter the
// kernel moves on every committed change to any nf_tables table there,
// iptables-nft's included. While it has not moved since a rule set was
// proven intact, that set is still intact, so a verifier can skip reading
// the whole set back (one netlink round trip instead of a dozen, and no
// iptables-save for the iptables-nft backend). It says nothing about
// iptables-legacy's tables or the policy routing.
func Generation(ns *os.File) (uint32, error) {
	nl, err := netns.OpenNetlink(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		return 0, fmt.Errorf("redirect: netfilter netlink: %w", err)
	}
	defer nl.Close()
	gen, found := uint32(0), false
	var parseErr error
	// nfgenmsg: family, version, resource id; then attributes.
	err = nl.Request(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_GETGEN, 0, []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0}, func(_ uint16, msg []byte) {
		if len(msg) < 4 {
			return
		}
		ad, err := netlink.NewAttributeDecoder(msg[4:])
		if err != nil {
			parseErr = err
			return
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				gen, found = ad.Uint32(), true
			}
		}
		parseErr = ad.Err()
	})
	switch {
	case err != nil:
		return 0, fmt.Errorf("redirect: read the nf_tables generation: %w", err)
	case parseErr != nil:
		return 0, fmt.Errorf("redirect: read the nf_tables generation: %w", parseErr)
	case !found:
		return 0, errors.New("redirect: the kernel sent no nf_tables generation")
	}
	return gen, nil
}
