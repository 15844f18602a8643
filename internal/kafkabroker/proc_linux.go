package kafkabroker

import (
	"os/exec"
	"runtime"
	"syscall"
)

// startOwned starts cmd so that the kernel kills it (SIGKILL) when this
// process dies, however it dies: a test binary killed by its timeout or by
// SIGKILL leaves no JVM behind. The parent-death signal fires when the
// thread that forked the child exits, so the fork happens on a thread
// locked to a goroutine that lives until the child has exited (Go never
// reuses a thread that a goroutine left locked). It returns a channel that
// receives cmd.Wait's result.
func startOwned(cmd *exec.Cmd) (<-chan error, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	started := make(chan error, 1)
	exited := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine, after the child
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		exited <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return exited, nil
}
