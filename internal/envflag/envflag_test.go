package envflag

import (
	"bytes"
	"flag"
	"strings"
	"testing"
	"time"
)

func TestEnvFillsUnsetFlagsAndFlagWins(t *testing.T) {
	t.Setenv("INPOD_ACK_TIMEOUT", "7s")
	t.Setenv("INPOD_UDS", "/from/env")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	ack := fs.Duration("ack-timeout", time.Second, "")
	uds := fs.String("uds", "/default", "")
	if err := Parse(fs, "x", []string{"--uds", "/from/flag"}); err != nil {
		t.Fatal(err)
	}
	if *ack != 7*time.Second {
		t.Errorf("ack-timeout = %v, want 7s from INPOD_ACK_TIMEOUT", *ack)
	}
	if *uds != "/from/flag" {
		t.Errorf("uds = %q, want the flag's value over the env's", *uds)
	}
}

func TestBadEnvValueNamesVariable(t *testing.T) {
	t.Setenv("INPOD_ACK_TIMEOUT", "soon")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.Duration("ack-timeout", time.Second, "")
	err := Parse(fs, "x", nil)
	if err == nil || !strings.Contains(err.Error(), "INPOD_ACK_TIMEOUT") {
		t.Fatalf("err = %v, want one naming INPOD_ACK_TIMEOUT", err)
	}
}

func TestHelpListsEnvNames(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var buf bytes.Buffer
	fs.SetOutput(&buf)
	fs.String("cni-socket", "/var/run/inpod/cni.sock", "where the plugin connects")
	if err := Parse(fs, "summary", []string{"--help"}); err != flag.ErrHelp {
		t.Fatalf("err = %v, want flag.ErrHelp", err)
	}
	for _, want := range []string{"--cni-socket", "$INPOD_CNI_SOCKET", "default /var/run/inpod/cni.sock", "summary"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("help lacks %q:\n%s", want, buf.String())
		}
	}
}
