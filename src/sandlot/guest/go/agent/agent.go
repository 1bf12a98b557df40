package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"sync"
	"syscall"

	"sandlot/guest/wire"
)

// reply is the fields of an answer; a nil reply sends nothing (the handler streamed its
// own end), an empty one a bare `ok`.
type reply = map[string]any

type handler func(rid int64, h wire.Header, payload []byte) (reply, error)

type agent struct {
	ch       *channel
	handlers map[string]handler

	procsMu sync.Mutex
	procs   map[int]*proc
	order   []int // pids in the order they were started (ps, trimming)

	stateMu    sync.Mutex // env and generation
	env        [][2]string
	generation string

	uploadsMu sync.Mutex
	uploads   map[int64]*upload

	readsMu sync.Mutex
	reads   map[int64]*credits

	configureMu sync.Mutex

	vol volCalls // guest -> host requests of mounted volumes
}

func newAgent(ch *channel) *agent {
	a := &agent{ch: ch, procs: map[int]*proc{}, generation: "0",
		uploads: map[int64]*upload{}, reads: map[int64]*credits{}}
	// One handler per op of the protocol (guest/protocol.py OPS; tests check the two agree).
	a.handlers = map[string]handler{
		"hello": a.opHello, "ping": a.opPing, "step_clock": a.opStepClock,
		"configure": a.opConfigure, "exec": a.opExec, "attach": a.opAttach,
		"stdin": a.opStdin, "kill": a.opKill, "ps": a.opPs, "read": a.opRead,
		"write": a.opWrite, "list": a.opList, "stat": a.opStat, "exists": a.opExists,
		"remove": a.opRemove, "mkdir": a.opMkdir, "rename": a.opRename,
		"resize": a.opResize, "mount": a.opMount,
	}
	return a
}

// ---- dispatch ------------------------------------------------------------------------------

func (a *agent) handle(h wire.Header, payload []byte) {
	if h.Has("vreq") { // the host's answer to a volume's request
		a.volAnswer(h, payload)
		return
	}
	rid, ok := h.ID()
	if !ok {
		return
	}
	op, isStr := h.Str("op")
	if isStr && (op == "chunk" || op == "end") {
		a.uploadsMu.Lock()
		up := a.uploads[rid]
		a.uploadsMu.Unlock()
		if up != nil {
			a.uploadFrame(rid, up, op, payload)
			return
		}
	}
	if isStr && op == "credit" {
		n, _, _ := h.Int("n")
		a.credit(rid, n)
		return
	}
	fn := a.handlers[op]
	if !isStr || fn == nil {
		a.replyError(rid, "invalid", "unknown op "+wire.PyRepr(h["op"]))
		return
	}
	// These run in order with the frames around them: a hello resets the session before
	// the next request is read, a write's chunks find its upload.
	if op == "hello" || op == "write" || op == "ping" || op == "stdin" {
		a.run(fn, rid, h, payload)
	} else {
		go a.run(fn, rid, h, payload)
	}
}

func (a *agent) run(fn handler, rid int64, h wire.Header, payload []byte) {
	result, err := a.call(fn, rid, h, payload)
	if err != nil {
		kind, msg := errorKind(err)
		a.replyError(rid, kind, msg)
		return
	}
	if result == nil {
		return
	}
	result["id"] = rid
	result["ok"] = true
	if err := a.ch.send(result, nil); errors.Is(err, wire.ErrTooLarge) {
		// An answer too large for a frame: say so, don't go silent.
		a.replyError(rid, "invalid", "the answer is too large for one frame")
	}
}

// call runs a handler; the agent must survive anything a request does.
func (a *agent) call(fn handler, rid int64, h wire.Header, payload []byte) (
	result reply, err error) {
	defer func() {
		if r := recover(); r != nil {
			result, err = nil, &agentError{"internal", fmt.Sprintf("panic: %v", r)}
		}
	}()
	return fn(rid, h, payload)
}

func (a *agent) replyError(rid int64, kind, message string) {
	if len(message) > 4000 {
		message = message[:4000]
	}
	a.ch.send(map[string]any{"id": rid, "error": map[string]any{
		"type": kind, "message": message}}, nil)
}

func (a *agent) credit(rid int64, n int64) {
	a.readsMu.Lock()
	c := a.reads[rid]
	a.readsMu.Unlock()
	if c != nil {
		c.give(n)
	}
}

func (a *agent) setRead(rid int64, c *credits) {
	a.readsMu.Lock()
	a.reads[rid] = c
	a.readsMu.Unlock()
}

func (a *agent) dropRead(rid int64) {
	a.readsMu.Lock()
	delete(a.reads, rid)
	a.readsMu.Unlock()
}

// ---- errors --------------------------------------------------------------------------------

// agentError is an error reply of a given kind (protocol.ERROR_TYPES).
type agentError struct{ kind, message string }

func (e *agentError) Error() string { return e.message }

func invalid(format string, args ...any) error {
	return &agentError{"invalid", fmt.Sprintf(format, args...)}
}

// errorKind maps an error to the reply's type and message, as the Python agent did: a missing
// file is not_found, EACCES/EPERM permission, any other system error invalid.
func errorKind(err error) (string, string) {
	var ae *agentError
	if errors.As(err, &ae) {
		return ae.kind, ae.message
	}
	name := ""
	var pe *fs.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		name = pe.Path
	case errors.As(err, &le):
		name = le.Old
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return "internal", err.Error()
	}
	switch errno {
	case syscall.ENOENT:
		return "not_found", name + ": no such file or directory"
	case syscall.EACCES, syscall.EPERM:
		return "permission", name + ": permission denied"
	}
	return "invalid", name + ": " + strerror(errno)
}

// strerror is the C library's wording ("No such file or directory").
func strerror(errno syscall.Errno) string {
	s := errno.Error()
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}
