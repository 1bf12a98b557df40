// sandlot-jail confines the command it is given and becomes it: one exec instead of the
// chain of shell, nsenter, unshare, mount, pivot_root and setpriv (vmm/jail.py).
//
//	sandlot-jail [--cgroup DIR]... [--netns NAME] [--fstab FILE --root DIR]
//	    --uid UID --gid GID --groups G1,G2 -- COMMAND ARGS...
//
// In order: it joins each cgroup, enters the network namespace /run/netns/NAME, makes a
// private mount namespace whose root shows only the FILE's mounts (bind mounts and proc,
// mounted on DIR, which becomes the root), drops every capability from its bounding and
// inheritable sets, takes the uid, gid and groups, sets no_new_privs and execs COMMAND
// (looked up in $PATH inside the new root) with the environment it was given. Namespaces,
// credentials and capability sets are per thread in Linux: everything runs on the thread
// that execs. Any failure exits 125 with a message on stderr, before COMMAND runs.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

func init() {
	runtime.LockOSThread() // the main goroutine stays on the thread that execs
}

type options struct {
	cgroups []string
	netns   string
	fstab   string
	root    string
	uid     int
	gid     int
	groups  []int
	argv    []string
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "sandlot-jail: "+format+"\n", args...)
	os.Exit(125)
}

func parse(args []string) options {
	o := options{uid: -1, gid: -1}
	for i := 0; i < len(args); i++ {
		arg := args[i]
		if arg == "--" {
			o.argv = args[i+1:]
			break
		}
		if i+1 >= len(args) {
			fail("%s needs a value", arg)
		}
		value := args[i+1]
		i++
		var err error
		switch arg {
		case "--cgroup":
			o.cgroups = append(o.cgroups, value)
		case "--netns":
			o.netns = value
		case "--fstab":
			o.fstab = value
		case "--root":
			o.root = value
		case "--uid":
			o.uid, err = strconv.Atoi(value)
		case "--gid":
			o.gid, err = strconv.Atoi(value)
		case "--groups":
			for _, g := range strings.Split(value, ",") {
				if g == "" {
					continue
				}
				n, e := strconv.Atoi(g)
				if e != nil {
					err = e
				}
				o.groups = append(o.groups, n)
			}
		default:
			fail("unknown option %s", arg)
		}
		if err != nil {
			fail("%s %s: %v", arg, value, err)
		}
	}
	if len(o.argv) == 0 {
		fail("no command")
	}
	if o.uid <= 0 || o.gid <= 0 {
		fail("--uid and --gid must be set, and not root")
	}
	if (o.fstab == "") != (o.root == "") {
		fail("--fstab and --root go together")
	}
	return o
}

func joinCgroups(dirs []string) {
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), pid, 0); err != nil {
			fail("joining cgroup %s: %v", d, err)
		}
	}
}

func enterNetns(name string) {
	path := filepath.Join("/run/netns", name)
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		fail("opening %s: %v", path, err)
	}
	if _, _, e := syscall.RawSyscall(sysSetns, uintptr(fd), syscall.CLONE_NEWNET, 0); e != 0 {
		fail("entering %s: %v", path, e)
	}
	syscall.Close(fd)
}

var mountFlags = map[string]uintptr{
	"nosuid": syscall.MS_NOSUID, "nodev": syscall.MS_NODEV, "noexec": syscall.MS_NOEXEC,
	"ro": syscall.MS_RDONLY,
}

// mountAll mounts an fstab of the lines vmm/jail.View writes: bind mounts (read-only with
// "ro") and proc filesystems; other options are the filesystem's data.
func mountAll(fstab string) {
	text, err := os.ReadFile(fstab)
	if err != nil {
		fail("reading %s: %v", fstab, err)
	}
	for _, line := range strings.Split(string(text), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) < 4 {
			fail("%s: bad line %q", fstab, line)
		}
		src, dst, fstype := f[0], f[1], f[2]
		var flags uintptr
		var data []string
		bind := false
		for _, opt := range strings.Split(f[3], ",") {
			if opt == "bind" {
				bind = true
			} else if flag, ok := mountFlags[opt]; ok {
				flags |= flag
			} else if opt != "defaults" && opt != "rw" {
				data = append(data, opt)
			}
		}
		if bind {
			if err := syscall.Mount(src, dst, "", syscall.MS_BIND, ""); err != nil {
				fail("bind mounting %s on %s: %v", src, dst, err)
			}
			if flags != 0 { // a bind mount takes its flags by a remount
				err := syscall.Mount("", dst, "", syscall.MS_BIND|syscall.MS_REMOUNT|flags, "")
				if err != nil {
					fail("remounting %s (%s): %v", dst, f[3], err)
				}
			}
			continue
		}
		if err := syscall.Mount(src, dst, fstype, flags, strings.Join(data, ",")); err != nil {
			fail("mounting %s on %s: %v", fstype, dst, err)
		}
	}
}

func enterRoot(fstab, root string) {
	if err := syscall.Unshare(syscall.CLONE_NEWNS); err != nil {
		fail("unshare: %v", err)
	}
	if err := syscall.Mount("none", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		fail("making the mounts private: %v", err)
	}
	mountAll(fstab)
	if err := syscall.Chdir(root); err != nil {
		fail("chdir %s: %v", root, err)
	}
	if err := syscall.PivotRoot(".", ".old"); err != nil {
		fail("pivot_root: %v", err)
	}
	if err := syscall.Unmount("/.old", syscall.MNT_DETACH); err != nil {
		fail("unmounting the old root: %v", err)
	}
	if err := syscall.Chdir("/"); err != nil {
		fail("chdir /: %v", err)
	}
}

const (
	prCapbsetDrop    = 24
	prSetNoNewPrivs  = 38
	linuxCapability3 = 0x20080522
)

type capHeader struct {
	version uint32
	pid     int32
}

type capData struct {
	effective, permitted, inheritable uint32
}

// dropCapabilities empties the bounding set and the inheritable set (the uid change then
// clears the permitted and effective ones: nothing is kept across it).
func dropCapabilities() {
	last := 63
	if text, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(text))); err == nil {
			last = n
		}
	}
	for c := 0; c <= last; c++ {
		_, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prCapbsetDrop, uintptr(c), 0)
		if e != 0 && e != syscall.EINVAL {
			fail("dropping capability %d from the bounding set: %v", c, e)
		}
	}
	hdr := capHeader{version: linuxCapability3}
	var data [2]capData
	if _, _, e := syscall.RawSyscall(syscall.SYS_CAPGET, uintptr(unsafe.Pointer(&hdr)),
		uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		fail("capget: %v", e)
	}
	data[0].inheritable, data[1].inheritable = 0, 0
	if _, _, e := syscall.RawSyscall(syscall.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)),
		uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		fail("capset: %v", e)
	}
}

// becomeUser sets groups, gid and uid on this thread only (raw system calls: Go's own
// wrappers change every thread, which the exec makes moot).
func becomeUser(uid, gid int, groups []int) {
	gids := make([]uint32, len(groups))
	for i, g := range groups {
		gids[i] = uint32(g)
	}
	var p unsafe.Pointer
	if len(gids) > 0 {
		p = unsafe.Pointer(&gids[0])
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETGROUPS, uintptr(len(gids)),
		uintptr(p), 0); e != 0 {
		fail("setgroups: %v", e)
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESGID, uintptr(gid), uintptr(gid),
		uintptr(gid)); e != 0 {
		fail("setresgid: %v", e)
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, uintptr(uid), uintptr(uid),
		uintptr(uid)); e != 0 {
		fail("setresuid: %v", e)
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetNoNewPrivs, 1, 0); e != 0 {
		fail("no_new_privs: %v", e)
	}
}

// lookPath finds a command in $PATH as execvp does (inside the new root).
func lookPath(name string) string {
	if strings.Contains(name, "/") {
		return name
	}
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if dir == "" {
			dir = "."
		}
		path := filepath.Join(dir, name)
		if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() &&
			st.Mode().Perm()&0o111 != 0 {
			return path
		}
	}
	fail("%s: not found in PATH", name)
	return ""
}

func main() {
	o := parse(os.Args[1:])
	joinCgroups(o.cgroups)
	if o.netns != "" {
		enterNetns(o.netns)
	}
	if o.fstab != "" {
		enterRoot(o.fstab, o.root)
	}
	dropCapabilities()
	becomeUser(o.uid, o.gid, o.groups)
	path := lookPath(o.argv[0])
	err := syscall.Exec(path, o.argv, os.Environ())
	fail("exec %s: %v", path, err)
}
