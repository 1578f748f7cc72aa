package fleet

import "syscall"

// The child dies with its parent, so an interrupted demo or harness leaves
// no workers behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
