// Command localnode runs the test harness's single-node Kubernetes for a
// person to use (make cluster-up / make cluster-down).
//
//	localnode up     start the node, print the kubeconfig path, keep it running in the background
//	localnode down   stop it and remove everything it created
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/inpod-dev/inpod/e2e/cluster"
	"github.com/inpod-dev/inpod/internal/envflag"
)

func main() {
	fs := flag.NewFlagSet("localnode", flag.ContinueOnError)
	root := fs.String("root", "/var/lib/inpod-e2e", "state root of the node")
	repo := fs.String("repo", ".", "inpod repository (for building images)")
	foreground := fs.Bool("foreground", false, "with up: keep running in the foreground until SIGINT/SIGTERM")
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: localnode up|down [flags]")
		os.Exit(2)
	}
	err := envflag.Parse(fs, "localnode: a real single-node Kubernetes on this machine, for tests and by hand", os.Args[2:])
	if err == flag.ErrHelp {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	holder := *root + ".holder"
	switch os.Args[1] {
	case "up":
		if *foreground {
			err = runForeground(*root, *repo, holder)
		} else {
			err = detach(*root, holder)
		}
	case "down":
		err = down(*root, holder)
	default:
		err = fmt.Errorf("unknown command %q: want up or down", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "localnode:", err)
		os.Exit(1)
	}
}

// detach starts a foreground copy of itself in its own session and waits
// for it to report the node ready (or fail).
func detach(root, holder string) error {
	if pid, ok := holderPID(holder); ok {
		return fmt.Errorf("a node is already running (pid %d); run localnode down first", pid)
	}
	logPath := root + ".log"
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	self, _ := os.Executable()
	cmd := exec.Command(self, append([]string{"up", "--foreground"}, os.Args[2:]...)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	kubeconfig := filepath.Join(root, "admin.kubeconfig")
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("node failed to start (%v); see %s", err, logPath)
		case <-time.After(200 * time.Millisecond):
		}
		if data, err := os.ReadFile(logPath); err == nil && strings.Contains(string(data), "node ready") {
			fmt.Printf("node ready; kubeconfig: %s\n  export KUBECONFIG=%s\nlogs: %s and %s/logs/\nstop with: make cluster-down\n", kubeconfig, kubeconfig, logPath, root)
			return nil
		}
	}
}

func runForeground(root, repo, holder string) error {
	if err := os.WriteFile(holder, []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return err
	}
	defer os.Remove(holder)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	abs, _ := filepath.Abs(repo)
	node, err := cluster.StartNode(ctx, cluster.NodeConfig{Config: cluster.Config{Root: root}, RepoDir: abs})
	if err != nil {
		return err
	}
	fmt.Printf("node ready: %s, kubeconfig %s\n", node.Name, node.Kubeconfig)
	<-ctx.Done()
	fmt.Println("stopping node")
	return node.Stop()
}

func down(root, holder string) error {
	if pid, ok := holderPID(holder); ok {
		syscall.Kill(pid, syscall.SIGTERM)
		deadline := time.Now().Add(2 * time.Minute)
		for time.Now().Before(deadline) {
			if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	os.Remove(holder)
	os.Remove(root + ".log")
	return cluster.Cleanup(root)
}

func holderPID(holder string) (int, bool) {
	data, err := os.ReadFile(holder)
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || syscall.Kill(pid, 0) != nil {
		return 0, false
	}
	return pid, true
}
