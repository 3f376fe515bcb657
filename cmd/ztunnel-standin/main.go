// Command ztunnel-standin plays Istio's ztunnel for inpod's tests and demo:
// it speaks ZDS to the agent and binds real listeners inside each pod's
// network namespace, but proxies nothing. See package e2e/ztunnel.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/inpod-dev/inpod/internal/envflag"
	"github.com/inpod-dev/inpod/zds"
	ztunnel "github.com/inpod-dev/inpod/zds/zdstest"
)

func main() {
	fs := flag.NewFlagSet("ztunnel-standin", flag.ContinueOnError)
	uds := fs.String("uds", zds.DefaultSocketPath, "the agent's ZDS socket (ztunnel reads the same INPOD_UDS)")
	dns := fs.Bool("dns", false, "also bind the DNS capture port 15053")
	ackDelay := fs.Duration("ack-delay", 0, "hold every ack back this long (fault injection)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	record := fs.String("record", "", "append a JSON line per acknowledged Add and closed workload to this file (for tests judging the stand-in from outside)")
	err := envflag.Parse(fs, "ztunnel-standin: a test peer that plays ztunnel on the ZDS socket (not a proxy)", os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		fmt.Fprintf(os.Stderr, "invalid --log-level %q: %v\n", *logLevel, err)
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cfg := ztunnel.Config{SocketPath: *uds, DNS: *dns, AckDelay: *ackDelay, Logger: log}
	if *record != "" {
		if err := os.MkdirAll(filepath.Dir(*record), 0o755); err != nil {
			log.Error("record", "err", err)
			os.Exit(1)
		}
		f, err := os.OpenFile(*record, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			log.Error("record", "err", err)
			os.Exit(1)
		}
		defer f.Close()
		cfg.Record = f
	}
	z := ztunnel.New(cfg)
	if err := z.Run(ctx); err != nil {
		log.Error("stand-in stopped", "err", err)
		os.Exit(1)
	}
}
