package testskip

import (
	"os"
	"syscall"
)

// Linux's system call numbers, the same on every architecture since 5.6.
const (
	sysPidfdOpen  = 434
	sysPidfdGetfd = 438
)

// dupFD copies descriptor fd of process pid into this process (it shares
// the open file and its offset), or returns nil when the kernel refuses.
func dupFD(pid, fd int) *os.File {
	pidfd, _, errno := syscall.Syscall(sysPidfdOpen, uintptr(pid), 0, 0)
	if errno != 0 {
		return nil
	}
	defer syscall.Close(int(pidfd))
	nfd, _, errno := syscall.Syscall(sysPidfdGetfd, pidfd, uintptr(fd), 0)
	if errno != 0 {
		return nil
	}
	return os.NewFile(nfd, "go command's stdout")
}
