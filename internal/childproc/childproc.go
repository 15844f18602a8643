// Package childproc runs the test binary itself as a child process, for
// tests that kill (SIGKILL) or freeze (SIGSTOP) a component for real. The
// child runs with "-test.run=^$" and the given environment; the test
// binary's TestMain recognizes it by that environment and runs the
// component instead of the tests.
package childproc

import (
	"bytes"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// stopTimeout is how long a test's cleanup waits for a child to exit
// after SIGTERM before it kills it.
const stopTimeout = 30 * time.Second

// Proc is a child process of the test binary.
type Proc struct {
	cmd  *exec.Cmd
	out  bytes.Buffer
	done chan struct{}
	err  error
}

// Start runs the test binary as a child with env added to this process's
// environment. When the test ends, the child is resumed (if stopped), sent
// SIGTERM, and killed if it has not exited within 30 s; its output is
// logged if the test failed.
func Start(t testing.TB, env ...string) *Proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	p := &Proc{cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start a child process: %v", err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(stopTimeout):
			_ = cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() && p.out.Len() > 0 {
			t.Logf("child process %d output:\n%s", cmd.Process.Pid, p.out.String())
		}
	})
	return p
}

// Signal sends sig to the child.
func (p *Proc) Signal(sig syscall.Signal) error { return p.cmd.Process.Signal(sig) }

// Kill ends the child with SIGKILL and waits for it to exit.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Done is closed when the child has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Err is what waiting for the child returned; read it after Done.
func (p *Proc) Err() error { return p.err }

// KilledBy reports whether the child died of sig; call it after Done.
func (p *Proc) KilledBy(sig syscall.Signal) bool {
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == sig
}
