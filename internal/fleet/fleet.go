// Package fleet runs leasehold processes (`leasehold worker`, `leasehold
// sink`) as children of the current one, and injects process faults into
// them: pause (SIGSTOP), resume (SIGCONT), kill (SIGKILL) and graceful stop
// (SIGTERM). The demo, the chaos harness and the benchmarks use it.
//
// Children run the current executable. A test binary is not the leasehold
// command, so children get SelfExecEnv set, and a test main that sees it
// runs the command instead of the tests (see RunIfChild).
package fleet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// SelfExecEnv is set in every child's environment.
const SelfExecEnv = "LEASEHOLD_SELF_EXEC"

// IsChild reports whether this process was started by fleet.
func IsChild() bool { return os.Getenv(SelfExecEnv) != "" }

// Options configure Start.
type Options struct {
	// Binary is the executable to run. Default: this process's own.
	Binary string
	// LogDir receives <name>.log with the child's stdout and stderr.
	// Default: discard them.
	LogDir string
	// Env is added to the inherited environment.
	Env []string
}

// Proc is one child process.
type Proc struct {
	Name string
	cmd  *exec.Cmd
	log  *os.File

	mu     sync.Mutex
	paused bool
	done   chan struct{}
	err    error
}

// Start starts `<binary> args...` as a child named name. The child is
// killed if this process dies.
func Start(name string, args []string, opts Options) (*Proc, error) {
	bin := opts.Binary
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("fleet: find this executable: %w", err)
		}
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(append(os.Environ(), SelfExecEnv+"=1"), opts.Env...)
	cmd.SysProcAttr = sysProcAttr()
	p := &Proc{Name: name, cmd: cmd, done: make(chan struct{})}
	if opts.LogDir != "" {
		if err := os.MkdirAll(opts.LogDir, 0o755); err != nil {
			return nil, fmt.Errorf("fleet: %w", err)
		}
		f, err := os.Create(filepath.Join(opts.LogDir, name+".log"))
		if err != nil {
			return nil, fmt.Errorf("fleet: %w", err)
		}
		p.log = f
		cmd.Stdout, cmd.Stderr = f, f
	}
	if err := cmd.Start(); err != nil {
		if p.log != nil {
			p.log.Close()
		}
		return nil, fmt.Errorf("fleet: start %s: %w", name, err)
	}
	go func() {
		err := cmd.Wait()
		if p.log != nil {
			p.log.Close()
		}
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// Pid is the child's process ID.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Exited is closed when the child has exited.
func (p *Proc) Exited() <-chan struct{} { return p.done }

// Err is the child's exit error once it has exited.
func (p *Proc) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Paused reports whether the child is stopped by Pause.
func (p *Proc) Paused() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.paused
}

// Pause stops the child (SIGSTOP): it cannot run, renew or notice time
// passing until Resume.
func (p *Proc) Pause() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.signal(syscall.SIGSTOP); err != nil {
		return err
	}
	p.paused = true
	return nil
}

// Resume continues a paused child (SIGCONT).
func (p *Proc) Resume() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.signal(syscall.SIGCONT); err != nil {
		return err
	}
	p.paused = false
	return nil
}

// Kill kills the child at once (SIGKILL).
func (p *Proc) Kill() error { return p.signal(syscall.SIGKILL) }

// Term asks the child to stop gracefully (SIGTERM), resuming it first if
// it is paused.
func (p *Proc) Term() error {
	if p.Paused() {
		_ = p.Resume()
	}
	return p.signal(syscall.SIGTERM)
}

func (p *Proc) signal(sig syscall.Signal) error {
	select {
	case <-p.done:
		return fmt.Errorf("fleet: %s has exited", p.Name)
	default:
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("fleet: signal %s: %w", p.Name, err)
	}
	return nil
}

// Stop stops the child gracefully and waits up to grace for it, then kills
// it. It returns the child's exit error (nil for a clean exit).
func (p *Proc) Stop(grace time.Duration) error {
	select {
	case <-p.done:
		return p.Err()
	default:
	}
	_ = p.Term()
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.Kill()
		<-p.done
		return fmt.Errorf("fleet: %s did not stop within %v and was killed", p.Name, grace)
	}
	return p.Err()
}

// Wait waits for the child to exit or ctx to end.
func (p *Proc) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}
