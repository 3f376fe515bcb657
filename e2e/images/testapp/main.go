// Command testapp is the application the end-to-end tests run in pods. It
// serves TCP on --listen and answers each connection with one line naming
// itself, the peer and the connection's original destination, so a test can
// tell whether traffic reached the app directly or through a redirect; with
// --dial ADDR it connects out once and prints what the other side said.
//
// At start it prints which of ztunnel's in-pod listeners were bound in its
// netns when the app began (read from /proc/net/tcp*, which any process may
// read): the kernel's view at the moment that matters, since an enrolled
// app that starts before redirection is in place has already run outside
// the mesh, whatever happens later.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve on")
	echo := flag.String("echo", "", "also serve an echo on this address: each connection stays open and gets its lines back")
	dial := flag.String("dial", "", "connect to this address once, print the reply and exit")
	flag.Parse()
	// The clock is the node's, as in the stand-in's record: a test can
	// order this moment against ztunnel's acks, finer than the API's
	// one-second StartedAt. Taken before the read, so whatever was bound
	// by then shows.
	fmt.Printf("testapp started at: %s\n", time.Now().UTC().Format(time.RFC3339Nano))
	listeners := ztunnelListeners()
	// And after it: a listener closed before this moment may be why the
	// read missed it.
	fmt.Printf("testapp listeners read by: %s\n", time.Now().UTC().Format(time.RFC3339Nano))
	fmt.Printf("ztunnel listeners at start: %v\n", listeners)
	if *dial != "" {
		c, err := net.DialTimeout("tcp", *dial, 5*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(c)
		fmt.Println(string(b))
		if err != nil {
			os.Exit(1)
		}
		return
	}
	if *echo != "" {
		eln, err := net.Listen("tcp", *echo)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go func() {
			for {
				c, err := eln.Accept()
				if err != nil {
					continue
				}
				go func() { io.Copy(c, c); c.Close() }()
			}
		}()
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	host, _ := os.Hostname()
	fmt.Printf("testapp %s serving on %s\n", host, ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			continue
		}
		orig := ztunnel.OriginalDst(c.(*net.TCPConn))
		fmt.Printf("connection from %s to %s\n", c.RemoteAddr(), orig)
		fmt.Fprintf(c, "testapp host=%s orig=%s peer=%s\n", host, orig, c.RemoteAddr())
		c.Close()
	}
}

// ztunnelListeners are ztunnel's in-pod ports (15001 outbound, 15006
// inbound, 15008 HBONE) listening in this netns, sorted.
func ztunnelListeners() []int {
	var found []int
	for _, path := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			// sl local_address rem_address st ...: local is HEXIP:HEXPORT,
			// st 0A is LISTEN.
			fields := strings.Fields(sc.Text())
			if len(fields) < 4 || fields[3] != "0A" {
				continue
			}
			_, hexPort, ok := strings.Cut(fields[1], ":")
			if !ok {
				continue
			}
			port, err := strconv.ParseUint(hexPort, 16, 16)
			if err != nil {
				continue
			}
			if (port == 15001 || port == 15006 || port == 15008) && !slices.Contains(found, int(port)) {
				found = append(found, int(port))
			}
		}
		f.Close()
	}
	slices.Sort(found)
	return found
}
