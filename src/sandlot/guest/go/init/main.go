// Command sandlot-init is sandlot's guest init (PID 1): it mounts the basics, configures the
// network, runs the agent (again whenever it dies) and reaps every orphan. A static binary
// that needs nothing from the image: installed as /sbin/sandlot-init, the initramfs
// switch_roots into it.
package main

import (
	"fmt"
	"os"
	"syscall"
	"time"
)

const (
	agentPath = "/opt/sandlot/sandlot-agent"
	guestIP   = "10.0.2.15"
	prefixLen = 24
	gateway   = "10.0.2.2"
	dns       = "10.0.2.3"
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "sandlot-init: "+format+"\n", args...)
}

func mount(fstype, target, opts string) {
	os.MkdirAll(target, 0o755)
	if err := syscall.Mount(fstype, target, fstype, 0, opts); err != nil &&
		err != syscall.EBUSY {
		logf("mount %s on %s: %v", fstype, target, err)
	}
}

func setup() {
	mount("proc", "/proc", "")
	mount("sysfs", "/sys", "")
	mount("devtmpfs", "/dev", "")
	mount("devpts", "/dev/pts", "gid=5,mode=620,ptmxmode=666")
	mount("tmpfs", "/dev/shm", "mode=1777")
	mount("tmpfs", "/run", "mode=755")
	mount("tmpfs", "/tmp", "mode=1777")
	mount("cgroup2", "/sys/fs/cgroup", "")
	for _, link := range [][2]string{{"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"},
		{"stdout", "/proc/self/fd/1"}, {"stderr", "/proc/self/fd/2"}} {
		if _, err := os.Lstat("/dev/" + link[0]); err != nil {
			os.Symlink(link[1], "/dev/"+link[0])
		}
	}
	os.MkdirAll("/run/sandlot", 0o755)
	if err := syscall.Sethostname([]byte("sandlot")); err != nil {
		logf("hostname: %v", err)
	}
	if err := configureNetwork(); err != nil {
		logf("network: %v", err)
	}
	if err := os.WriteFile("/etc/resolv.conf", []byte("nameserver "+dns+"\n"), 0o644); err != nil {
		logf("resolv.conf: %v", err)
	}
}

func startAgent() int {
	for {
		p, err := os.StartProcess(agentPath, []string{agentPath}, &os.ProcAttr{
			Files: []*os.File{os.Stdin, os.Stdout, os.Stderr}})
		if err == nil {
			pid := p.Pid
			p.Release() // reaped by the loop below, with every other child
			return pid
		}
		logf("start %s: %v", agentPath, err)
		time.Sleep(time.Second)
	}
}

func main() {
	setup()
	agent := startAgent()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil { // ECHILD: nothing to reap (the agent is always there, but be safe)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if pid == agent {
			logf("agent exited (%v); restarting it", ws)
			time.Sleep(200 * time.Millisecond)
			agent = startAgent()
		}
	}
}
