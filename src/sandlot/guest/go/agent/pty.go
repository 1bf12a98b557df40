package main

import (
	"errors"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"sandlot/guest/wire"
)

// openPTY opens a new pseudo-terminal: its master side (pollable, for the agent) and its
// slave side (for the process).
func openPTY() (master, slave *os.File, err error) {
	fd, err := syscall.Open("/dev/ptmx",
		syscall.O_RDWR|syscall.O_NOCTTY|syscall.O_CLOEXEC|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, &os.PathError{Op: "open", Path: "/dev/ptmx", Err: err}
	}
	var unlock int32
	var index uint32
	if err := ioctl(fd, syscall.TIOCSPTLCK, uintptr(unsafe.Pointer(&unlock))); err != nil {
		syscall.Close(fd)
		return nil, nil, err
	}
	if err := ioctl(fd, syscall.TIOCGPTN, uintptr(unsafe.Pointer(&index))); err != nil {
		syscall.Close(fd)
		return nil, nil, err
	}
	name := "/dev/pts/" + strconv.FormatUint(uint64(index), 10)
	sfd, err := syscall.Open(name, syscall.O_RDWR|syscall.O_NOCTTY|syscall.O_CLOEXEC, 0)
	if err != nil {
		syscall.Close(fd)
		return nil, nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return os.NewFile(uintptr(fd), "/dev/ptmx"), os.NewFile(uintptr(sfd), name), nil
}

func ioctl(fd int, req uint, arg uintptr) error {
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), uintptr(req),
		arg); errno != 0 {
		return os.NewSyscallError("ioctl", errno)
	}
	return nil
}

// terminalSize reads a terminal's `cols` and `rows`: integers from 1 to 4096.
func terminalSize(h wire.Header) (cols, rows uint16, err error) {
	bad := invalid("a terminal's cols and rows are integers from 1 to 4096")
	var out [2]uint16
	for i, key := range []string{"cols", "rows"} {
		raw, ok := h.Raw(key)
		if !ok {
			return 0, 0, bad
		}
		v, err := strconv.ParseInt(string(raw), 10, 64)
		if err != nil || v < 1 || v > 4096 {
			return 0, 0, bad
		}
		out[i] = uint16(v)
	}
	return out[0], out[1], nil
}

// setWindowSize sets the size of the terminal whose master is f (the kernel sends SIGWINCH
// to its foreground process group).
func setWindowSize(f *os.File, h wire.Header) error {
	cols, rows, err := terminalSize(h)
	if err != nil {
		return err
	}
	ws := [4]uint16{rows, cols, 0, 0}
	conn, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ioErr error
	if err := conn.Control(func(fd uintptr) {
		ioErr = ioctl(int(fd), syscall.TIOCSWINSZ, uintptr(unsafe.Pointer(&ws)))
	}); err != nil {
		return err
	}
	return ioErr
}

// pumpTerminal is a terminal's output until every process on it is gone (EIO) or its first
// process ended (hungUp: background jobs then lose the terminal); it closes the master side.
func pumpTerminal(p *proc, wg interface{ Done() }) {
	defer wg.Done()
	defer func() {
		p.hungUp.Store(true)
		// Closing the master hangs the terminal up: SIGHUP to its session. A process that
		// closed its stdio (EIO) may still be running its last code: wait for it.
		<-p.exited
		p.master.Close()
	}()
	for !p.hungUp.Load() {
		buf := make([]byte, 65536)
		p.master.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, err := p.master.Read(buf)
		if n > 0 {
			p.emit("stdout", buf[:n:n])
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		if err != nil {
			return
		}
	}
}

// spawnOnTerminal starts `shell -c cmd` in a new session whose controlling terminal is a new
// pseudo-terminal of the given size.
func spawnOnTerminal(shell, cmd, cwd string, env []string, sys *syscall.SysProcAttr,
	size wire.Header) (*spawned, error) {
	master, slave, err := openPTY()
	if err != nil {
		return nil, err
	}
	defer slave.Close()
	if err := setWindowSize(master, size); err != nil {
		master.Close()
		return nil, err
	}
	sys.Setctty = true
	sys.Ctty = 0 // the child's descriptor 0: the terminal becomes its controlling one
	process, err := os.StartProcess(shell, []string{shell, "-c", cmd}, &os.ProcAttr{
		Dir: cwd, Env: env, Files: []*os.File{slave, slave, slave}, Sys: sys})
	if err != nil {
		master.Close()
		return nil, err
	}
	return &spawned{process: process, master: master}, nil
}

func (a *agent) opResize(rid int64, h wire.Header, _ []byte) (reply, error) {
	p, err := a.getProc(h)
	if err != nil {
		return nil, err
	}
	if p.master == nil {
		return nil, invalid("process %d has no terminal", p.pid)
	}
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done {
		return nil, invalid("process %d has exited", p.pid)
	}
	if err := setWindowSize(p.master, h); err != nil {
		return nil, err
	}
	return reply{}, nil
}
