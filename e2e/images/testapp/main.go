// Command testapp is the application the end-to-end tests run in pods. It
// serves TCP on --listen and answers each connection with one line naming
// itself, the peer and the connection's original destination, so a test can
// tell whether traffic reached the app directly or through a redirect; with
// --dial ADDR it connects out once and prints what the other side said.
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve on")
	dial := flag.String("dial", "", "connect to this address once, print the reply and exit")
	flag.Parse()
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
