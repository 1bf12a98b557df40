package main

import (
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"sandlot/guest/wire"
)

// channel is the virtio-serial port, non-blocking: writes under a lock, reads in the main
// loop. A read of the port returns at most one 4 KiB virtqueue buffer, so the reader uses
// readv with many buffers: one system call drains everything the host has queued (the port is
// non-blocking, so readv stops at the first empty buffer instead of waiting).
//
// The main loop waits for input in Go's poller (epoll), not in a blocking poll(2): a goroutine
// blocked in a system call keeps its P (the runtime's right to run Go code) until sysmon takes
// it back, so with GOMAXPROCS=1 (a guest with one CPU online) every request handed to a
// goroutine waited for sysmon first (~20 ms measured on a restored guest under TCG).
type channel struct {
	fd        int
	exitOnEOF bool // a test's socket: the host closing it ends the agent
	mu        sync.Mutex
	bufs      [][]byte
	iov       []syscall.Iovec
	file      *os.File        // owns fd once the poller has it (kept: its finalizer closes fd)
	rc        syscall.RawConn // nil: wait with poll(2) (an fd epoll does not take)
}

// pollWait is how long a read waits before it looks again: only a safety net, since the poller
// wakes the read when the host sends. It is long because every expiry wakes an idle guest
// (the read, then the runtime's sysmon polling for a while): at one second that cost an idle
// sandbox ~30 ms of host CPU per second under TCG, two thirds of all it used (bench/, "idle").
const pollWait = 30 * time.Second

func newChannel(fd int, exitOnEOF bool) *channel {
	f := os.NewFile(uintptr(fd), "sandlot-port") // non-blocking: registered with the poller
	c := &channel{fd: fd, exitOnEOF: exitOnEOF, file: f}
	if rc, err := f.SyscallConn(); err == nil && f.SetReadDeadline(time.Time{}) == nil {
		c.rc = rc
	}
	return c
}

const readBuffers = 256

type pollFd struct {
	fd      int32
	events  int16
	revents int16
}

func poll(fd int, events int16, timeout time.Duration) {
	p := pollFd{fd: int32(fd), events: events}
	syscall.Syscall(syscall.SYS_POLL, uintptr(unsafe.Pointer(&p)), 1,
		uintptr(timeout.Milliseconds()))
}

// send writes one frame; while no host is connected it waits for one to come back.
func (c *channel) send(header map[string]any, payload []byte) error {
	data, err := wire.Encode(header, payload)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(data) > 0 {
		n, err := syscall.Write(c.fd, data)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			poll(c.fd, pollOut, 100*time.Millisecond)
			continue
		case err != nil:
			if c.exitOnEOF {
				return err
			}
			time.Sleep(5 * time.Millisecond) // host away: wait for it to come back
			continue
		}
		data = data[n:]
	}
	return nil
}

const (
	pollIn  = 0x1
	pollOut = 0x4
)

// recv returns whatever the host has sent; nothing when no host is connected.
func (c *channel) recv() []byte {
	if c.bufs == nil {
		c.bufs = make([][]byte, readBuffers)
		c.iov = make([]syscall.Iovec, readBuffers)
		for i := range c.bufs {
			c.bufs[i] = make([]byte, 4096)
			c.iov[i].Base = &c.bufs[i][0]
			c.iov[i].SetLen(4096)
		}
	}
	for {
		var n uintptr
		var errno syscall.Errno
		read := func(fd uintptr) bool {
			n, _, errno = syscall.Syscall(syscall.SYS_READV, fd,
				uintptr(unsafe.Pointer(&c.iov[0])), uintptr(len(c.iov)))
			return errno != syscall.EAGAIN
		}
		if c.rc != nil {
			c.file.SetReadDeadline(time.Now().Add(pollWait))
			if err := c.rc.Read(read); err != nil {
				if !os.IsTimeout(err) {
					c.rc = nil // not pollable after all: poll(2) from now on
				}
				continue
			}
		} else {
			poll(c.fd, pollIn, pollWait)
			read(uintptr(c.fd))
		}
		if errno == syscall.EAGAIN || errno == syscall.EINTR {
			continue
		}
		if errno != 0 || n == 0 {
			return nil
		}
		out := make([]byte, 0, n)
		for i := 0; n > 0; i++ {
			k := int(n)
			if k > 4096 {
				k = 4096
			}
			out = append(out, c.bufs[i][:k]...)
			n -= uintptr(k)
		}
		return out
	}
}
