package cluster

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// process is one component the harness started. Its pid is recorded in the
// run's pids/ dir, so a later run can stop it if this one was killed.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	pidPath string
	exited  chan struct{}
	err     error
}

func startProcess(root, name, bin string, args []string, env []string) (*process, error) {
	for _, d := range []string{"logs", "pids"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, err
		}
	}
	logPath := filepath.Join(root, "logs", name+".log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Env = append(os.Environ(), env...)
	// Its own process group, so stopping it takes any children along, and
	// Pdeathsig so a killed harness does not leave it running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, exited: make(chan struct{}),
		pidPath: filepath.Join(root, "pids", name+".pid")}
	if err := os.WriteFile(p.pidPath, []byte(fmt.Sprintf("%d %s\n", cmd.Process.Pid, bin)), 0o644); err != nil {
		cmd.Process.Kill()
		return nil, err
	}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// running reports an error naming the log when the process has exited.
func (p *process) running() error {
	select {
	case <-p.exited:
		return fatal{fmt.Errorf("%s exited (%v); last log lines:\n%s", p.name, p.err, tail(p.logPath, 30))}
	default:
		return nil
	}
}

// stop sends SIGTERM to the process group, then SIGKILL after grace.
func (p *process) stop(grace time.Duration) {
	defer os.Remove(p.pidPath)
	select {
	case <-p.exited:
		return
	default:
	}
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(grace):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
}

// killRecorded stops processes a killed earlier run left behind: each pid
// file names a pid and its binary, and only a live process running that
// binary is killed (a recycled pid is left alone).
func killRecorded(pidDir string) error {
	entries, err := os.ReadDir(pidDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range entries {
		path := filepath.Join(pidDir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		fields := strings.Fields(string(data))
		if len(fields) == 2 {
			pid, _ := strconv.Atoi(fields[0])
			if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err == nil && pid > 1 && exe == fields[1] {
				syscall.Kill(-pid, syscall.SIGKILL)
				syscall.Kill(pid, syscall.SIGKILL)
				waitGone(pid, 5*time.Second)
			}
		}
		os.Remove(path)
	}
	return nil
}

func waitGone(pid int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// fatal marks an error that no amount of waiting fixes, such as a
// component that exited.
type fatal struct{ error }

// poll calls cond until it returns true, a fatal error, or the deadline;
// other errors are remembered for the timeout message.
func poll(timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		var f fatal
		if errors.As(err, &f) {
			return f.error
		}
		if err != nil {
			last = err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s (last error: %v)", timeout, what, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
