package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// statFields returns the fields of /proc/<pid>/stat after the command
// name, which is in parentheses and may hold spaces: the state is the
// first, the parent's ID the second, utime the 12th and stime the 13th.
func statFields(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return nil, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	return f, nil
}

// cpuOf is the CPU time, user and system, the processes have used; a
// process that has exited counts nothing.
func cpuOf(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		f, err := statFields(pid)
		if err != nil {
			continue
		}
		for _, v := range f[11:13] {
			t, _ := strconv.ParseInt(v, 10, 64)
			total += time.Duration(t) * 10 * time.Millisecond // USER_HZ: 100 on Linux
		}
	}
	return total
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(pid int) []int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var out []int
	for _, s := range stats {
		child, err := strconv.Atoi(filepath.Base(filepath.Dir(s)))
		if err != nil {
			continue
		}
		f, err := statFields(child)
		if err != nil {
			continue
		}
		if ppid, _ := strconv.Atoi(f[1]); ppid == pid {
			out = append(out, child)
		}
	}
	return out
}
