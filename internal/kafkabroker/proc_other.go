//go:build !linux

package kafkabroker

import "os/exec"

// startOwned starts cmd. Without Linux's parent-death signal, a process
// that dies without running its cleanup leaves the JVM running; Start
// removes data directories whose owner is gone, but not their JVMs.
func startOwned(cmd *exec.Cmd) (<-chan error, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	return exited, nil
}
