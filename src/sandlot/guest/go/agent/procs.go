package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"sandlot/guest/wire"
)

type chunk struct {
	stream string
	data   []byte
}

// proc is a process started by exec, with its buffered output and its subscribers.
type proc struct {
	a       *agent
	pid     int
	cmd     string
	user    string
	started float64

	master *os.File      // a terminal's master side: its input, output and size (nil: pipes)
	hungUp atomic.Bool   // set once the process ended: the terminal's pump stops
	exited chan struct{} // closed once its process has been waited for

	stdinMu   sync.Mutex
	stdinCond *sync.Cond
	stdin     *os.File // nil once closed
	ticket    uint64   // stdin writes are done in the order the host sent them
	turn      uint64

	mu          sync.Mutex
	chunks      []chunk
	buffered    int
	truncated   bool
	exitCode    int
	done        bool
	timedOut    bool
	subscribers map[int64]*credits // nil credits: no window
	waiting     int                // output pumps waiting for a subscriber's credit
}

func (p *proc) emit(stream string, data []byte) {
	p.mu.Lock()
	p.chunks = append(p.chunks, chunk{stream, data})
	p.buffered += len(data)
	for p.buffered > maxBufferedOutput && len(p.chunks) > 0 {
		p.buffered -= len(p.chunks[0].data)
		p.chunks[0] = chunk{}
		p.chunks = p.chunks[1:]
		p.truncated = true
	}
	subs := make(map[int64]*credits, len(p.subscribers))
	for rid, c := range p.subscribers {
		subs[rid] = c
	}
	p.mu.Unlock()
	for rid, c := range subs {
		p.send(rid, c, stream, data)
	}
}

// send is one output event to one subscriber, after its credit if it has a window (the
// calling pump, and so the process's pipe, waits for it).
func (p *proc) send(rid int64, c *credits, stream string, data []byte) bool {
	if c != nil {
		p.mu.Lock()
		p.waiting++
		p.mu.Unlock()
		ok := c.take()
		p.mu.Lock()
		p.waiting--
		p.mu.Unlock()
		if !ok {
			p.unsubscribe(rid, c)
			return false
		}
	}
	p.a.ch.send(map[string]any{"id": rid, "event": stream}, data)
	return true
}

func (p *proc) unsubscribe(rid int64, c *credits) {
	p.mu.Lock()
	_, ok := p.subscribers[rid]
	delete(p.subscribers, rid)
	p.mu.Unlock()
	if !ok {
		return
	}
	p.a.dropRead(rid)
	if !c.wasCancelled() { // the host went quiet rather than said it stopped
		p.a.replyError(rid, "internal", "output not consumed for "+
			fmt.Sprintf("%.0fs", creditTimeout.Seconds())+"; the stream was dropped")
	}
}

func (p *proc) finish(code int) {
	p.mu.Lock()
	p.exitCode = code
	p.done = true
	subs := make([]int64, 0, len(p.subscribers))
	for rid := range p.subscribers {
		subs = append(subs, rid)
	}
	p.subscribers = map[int64]*credits{}
	p.mu.Unlock()
	for _, rid := range subs {
		p.a.dropRead(rid)
		p.a.ch.send(p.result(rid), nil)
	}
}

// result is the exit event.
func (p *proc) result(rid int64) map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	return map[string]any{"id": rid, "event": "exit", "exit_code": p.exitCode,
		"timed_out": p.timedOut, "pid": p.pid}
}

func (p *proc) subscribe(rid int64, replay bool, c *credits) {
	p.mu.Lock()
	var chunks []chunk
	if replay {
		chunks = append(chunks, p.chunks...)
	}
	done := p.done
	if !done {
		p.subscribers[rid] = c
	}
	p.mu.Unlock()
	for _, ch := range chunks {
		if !p.send(rid, c, ch.stream, ch.data) {
			return
		}
	}
	if done {
		p.a.dropRead(rid)
		p.a.ch.send(p.result(rid), nil)
	}
}

func (p *proc) info() map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	var code any
	if p.done {
		code = p.exitCode
	}
	return map[string]any{"pid": p.pid, "cmd": p.cmd, "user": p.user, "running": !p.done,
		"exit_code": code, "started_at": p.started, "pty": p.master != nil}
}

func (p *proc) pumpsWaiting() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiting
}

// writeStdin writes to the process's input in ticket order; errors (it closed its input,
// it exited) are ignored, as a write to a closed pipe is.
func (p *proc) writeStdin(ticket uint64, data []byte, eof bool) {
	p.stdinMu.Lock()
	for p.turn != ticket {
		p.stdinCond.Wait()
	}
	f := p.stdin
	p.stdinMu.Unlock()
	if p.master != nil {
		if eof {
			data = append(append([]byte(nil), data...), 4) // Ctrl-D
		}
		if len(data) > 0 {
			p.master.Write(data) // fails once the terminal is gone: nothing to write to
		}
	} else if f != nil && len(data) > 0 {
		f.Write(data)
	}
	p.stdinMu.Lock()
	if eof && p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	p.turn++
	p.stdinCond.Broadcast()
	p.stdinMu.Unlock()
}

func (p *proc) nextTicket() uint64 {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	t := p.ticket
	p.ticket++
	return t
}

// ---- ops ---------------------------------------------------------------------------------

func (a *agent) opExec(rid int64, h wire.Header, payload []byte) (reply, error) {
	cmd, ok := h.Str("cmd")
	if !ok || cmd == "" {
		return nil, invalid("cmd must be a non-empty string")
	}
	user := "root"
	if h.Truthy("user") {
		u, ok := h.Str("user")
		if !ok {
			return nil, invalid("no such user: %s", wire.PyStr(h["user"]))
		}
		user = u
	}
	pw, ok := userByName(user)
	if !ok && user == "root" { // an image without /etc/passwd (distroless, scratch)
		pw, ok = passwdEntry{name: "root", dir: "/root"}, true
		if !isDir(pw.dir) {
			pw.dir = "/"
		}
	}
	if !ok {
		return nil, invalid("no such user: %s", user)
	}
	var size wire.Header
	if raw, ok := h.Raw("pty"); ok {
		if raw[0] != '{' || json.Unmarshal(raw, &size) != nil {
			return nil, invalid("pty must be an object with cols and rows")
		}
		if size == nil {
			size = wire.Header{}
		}
	}
	shell := shellPath()
	env := newEnv()
	env.set("PATH", defaultPath)
	env.set("HOME", pw.dir)
	env.set("USER", pw.name)
	env.set("LOGNAME", pw.name)
	env.set("SHELL", shell)
	env.set("LANG", "C.UTF-8")
	a.stateMu.Lock()
	env.set("SANDLOT_GENERATION", a.generation)
	if size != nil {
		env.set("TERM", "xterm-256color")
	}
	for _, kv := range a.env {
		env.set(kv[0], kv[1])
	}
	a.stateMu.Unlock()
	for _, kv := range stringMap(h, "env") {
		env.set(kv[0], kv[1])
	}
	cwd := pw.dir
	if h.Truthy("cwd") {
		cwd = wire.PyStr(h["cwd"])
	}
	if !isDir(cwd) {
		return nil, invalid("cwd %s: not a directory", cwd)
	}
	withStdin := h.Truthy("stdin")
	timeout, hasTimeout, err := h.Float("timeout")
	if err != nil {
		return nil, invalid("timeout must be a number")
	}
	window, _, _ := h.Int("window")

	sys := &syscall.SysProcAttr{Setsid: true}
	if pw.uid != os.Getuid() {
		sys.Credential = &syscall.Credential{Uid: uint32(pw.uid), Gid: uint32(pw.gid),
			Groups: supplementaryGroups(pw.name)}
	}
	var sp *spawned
	if size != nil {
		sp, err = spawnOnTerminal(shell, cmd, cwd, env.list(), sys, size)
	} else {
		sp, err = spawnPiped(shell, cmd, cwd, env.list(), sys)
	}
	if err != nil {
		return nil, err
	}
	p := &proc{a: a, pid: sp.process.Pid, cmd: cmd, user: user, stdin: sp.stdin,
		master:  sp.master,
		started: float64(time.Now().UnixNano()) / 1e9, subscribers: map[int64]*credits{}}
	p.stdinCond = sync.NewCond(&p.stdinMu)
	p.exited = make(chan struct{})
	if !h.Has("track") || h.Truthy("track") { // the host's own warm-up runs are not listed
		a.procsMu.Lock()
		if _, seen := a.procs[p.pid]; !seen {
			a.order = append(a.order, p.pid)
		}
		a.procs[p.pid] = p
		a.trimFinished()
		a.procsMu.Unlock()
	}
	if !h.Has("stream") || h.Truthy("stream") {
		var c *credits
		if window > 0 {
			c = newCredits(window)
			a.setRead(rid, c)
		}
		p.mu.Lock() // a hello may be resetting every process's subscribers
		p.subscribers[rid] = c
		p.mu.Unlock()
	}
	a.ch.send(map[string]any{"id": rid, "ok": true, "pid": p.pid, "event": "start"}, nil)
	var pumps sync.WaitGroup
	if p.master != nil {
		pumps.Add(1)
		go pumpTerminal(p, &pumps)
		if withStdin && len(payload) > 0 {
			p.writeStdin(p.nextTicket(), payload, false)
		}
	} else {
		pumps.Add(2)
		go pump(sp.stdout, p, "stdout", &pumps)
		go pump(sp.stderr, p, "stderr", &pumps)
		if withStdin {
			go p.writeStdin(p.nextTicket(), payload, true)
		} else if !h.Truthy("keep_stdin") {
			p.writeStdin(p.nextTicket(), nil, true)
		}
	}
	var limit time.Duration
	if hasTimeout && timeout > 0 {
		limit = time.Duration(timeout * float64(time.Second))
	}
	state := p.wait(sp.process, limit)
	close(p.exited)
	// A backgrounded grandchild may hold the pipes open: don't wait for it; but do wait for
	// output that only waits for the host's credit (it comes before the exit). A terminal's
	// output drains through one more hop (the line discipline): give it longer, unless
	// background jobs keep the terminal open.
	drain := 200 * time.Millisecond
	if p.master != nil {
		drain = terminalDrain
	}
	until := time.Now().Add(drain)
	pumped := make(chan struct{})
	go func() {
		pumps.Wait()
		close(pumped)
	}()
	for {
		select {
		case <-pumped:
		case <-time.After(200 * time.Millisecond):
			if p.pumpsWaiting() > 0 || time.Now().Before(until) {
				continue
			}
		}
		break
	}
	if p.master != nil {
		p.hungUp.Store(true) // a terminal's background jobs no longer hold its output open
		p.master.SetReadDeadline(time.Now())
	}
	p.finish(exitCode(state))
	return nil, nil
}

// spawned is a started process and the agent's ends of its standard streams.
type spawned struct {
	process               *os.Process
	stdin, stdout, stderr *os.File
	master                *os.File // on a terminal: its master side instead of the three
}

// spawnPiped starts `shell -c cmd` with pipes for its input and outputs.
func spawnPiped(shell, cmd, cwd string, env []string, sys *syscall.SysProcAttr) (
	*spawned, error) {
	var ends [6]*os.File // stdin r/w, stdout r/w, stderr r/w
	closeAll := func() {
		for _, f := range ends {
			if f != nil {
				f.Close()
			}
		}
	}
	for i := 0; i < 3; i++ {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll()
			return nil, err
		}
		ends[2*i], ends[2*i+1] = r, w
	}
	process, err := os.StartProcess(shell, []string{shell, "-c", cmd}, &os.ProcAttr{
		Dir: cwd, Env: env, Files: []*os.File{ends[0], ends[3], ends[5]}, Sys: sys})
	if err != nil {
		closeAll()
		return nil, err
	}
	for _, i := range []int{0, 3, 5} { // the child's ends
		ends[i].Close()
	}
	return &spawned{process: process, stdin: ends[1], stdout: ends[2], stderr: ends[4]}, nil
}

// wait waits for the process to end; past `limit` (if not 0) it kills its group first.
func (p *proc) wait(process *os.Process, limit time.Duration) *os.ProcessState {
	exited := make(chan *os.ProcessState, 1)
	go func() {
		state, _ := process.Wait()
		exited <- state
	}()
	if limit <= 0 {
		return <-exited
	}
	timer := time.NewTimer(limit)
	defer timer.Stop()
	select {
	case state := <-exited:
		return state
	case <-timer.C:
		p.mu.Lock()
		p.timedOut = true
		p.mu.Unlock()
		killGroup(p.pid, syscall.SIGKILL)
		return <-exited
	}
}

func exitCode(state *os.ProcessState) int {
	if state == nil {
		return -1
	}
	ws, ok := state.Sys().(syscall.WaitStatus)
	if ok && ws.Signaled() {
		return -int(ws.Signal())
	}
	return state.ExitCode()
}

func pump(f *os.File, p *proc, stream string, wg *sync.WaitGroup) {
	defer wg.Done()
	defer f.Close()
	buf := make([]byte, 65536)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			// A copy of its own size: the buffered output is counted by its length.
			p.emit(stream, append([]byte(nil), buf[:n]...))
		}
		if err != nil {
			return
		}
	}
}

// trimFinished keeps at most maxFinished finished processes (the oldest go); procsMu held.
func (a *agent) trimFinished() {
	var finished []int
	for _, pid := range a.order {
		if p := a.procs[pid]; p != nil {
			p.mu.Lock()
			if p.done {
				finished = append(finished, pid)
			}
			p.mu.Unlock()
		}
	}
	if len(finished) <= maxFinished {
		return
	}
	drop := map[int]bool{}
	for _, pid := range finished[:len(finished)-maxFinished] {
		delete(a.procs, pid)
		drop[pid] = true
	}
	kept := a.order[:0]
	for _, pid := range a.order {
		if !drop[pid] {
			kept = append(kept, pid)
		}
	}
	a.order = kept
}

func (a *agent) getProc(h wire.Header) (*proc, error) {
	pid, _, err := h.Int("pid")
	var p *proc
	if err == nil {
		a.procsMu.Lock()
		p = a.procs[int(pid)]
		a.procsMu.Unlock()
	}
	if p == nil {
		return nil, &agentError{"not_found", "no process " + wire.PyStr(h["pid"])}
	}
	return p, nil
}

func (a *agent) opAttach(rid int64, h wire.Header, _ []byte) (reply, error) {
	p, err := a.getProc(h)
	if err != nil {
		return nil, err
	}
	window, _, _ := h.Int("window")
	var c *credits
	if window > 0 {
		c = newCredits(window)
		a.setRead(rid, c)
	}
	p.subscribe(rid, !h.Has("replay") || h.Truthy("replay"), c)
	return nil, nil
}

func (a *agent) opStdin(rid int64, h wire.Header, payload []byte) (reply, error) {
	p, err := a.getProc(h)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done {
		return nil, invalid("process %d has exited", p.pid)
	}
	// Runs in the reader's order (handle), so writes keep the host's order; the write itself,
	// which may wait for the process to read, and the answer happen on their own.
	ticket := p.nextTicket()
	go func() {
		p.writeStdin(ticket, payload, h.Truthy("eof"))
		a.ch.send(map[string]any{"id": rid, "ok": true}, nil)
	}()
	return nil, nil
}

func (a *agent) opKill(rid int64, h wire.Header, _ []byte) (reply, error) {
	p, err := a.getProc(h)
	if err != nil {
		return nil, err
	}
	sig := int64(syscall.SIGKILL)
	if h.Truthy("signal") {
		if sig, _, err = h.Int("signal"); err != nil {
			return nil, invalid("signal must be a number")
		}
	}
	p.mu.Lock()
	running := !p.done // read before signalling: it may exit at once
	p.mu.Unlock()
	if running {
		if err := killGroup(p.pid, syscall.Signal(sig)); err != nil {
			return nil, err
		}
	}
	return reply{"killed": running}, nil
}

func (a *agent) opPs(rid int64, h wire.Header, _ []byte) (reply, error) {
	all := h.Truthy("all")
	a.procsMu.Lock()
	procs := make([]*proc, 0, len(a.order))
	for _, pid := range a.order {
		procs = append(procs, a.procs[pid])
	}
	a.procsMu.Unlock()
	out := []map[string]any{}
	for _, p := range procs {
		info := p.info()
		if all || info["running"] == true {
			out = append(out, info)
		}
	}
	return reply{"processes": out}, nil
}

func killGroup(pid int, sig syscall.Signal) error {
	err := syscall.Kill(-pid, sig)
	if err == syscall.ESRCH {
		return nil
	}
	if err != nil {
		return os.NewSyscallError("kill", err)
	}
	return nil
}

// shellPath is the shell commands run in: bash, or sh in an image without it.
func shellPath() string {
	if st, err := os.Stat("/bin/bash"); err == nil && st.Mode().IsRegular() {
		return "/bin/bash"
	}
	return "/bin/sh"
}

func isDir(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.IsDir()
}

// orderedEnv keeps the first position of each name and its last value, as a dict does.
type orderedEnv struct {
	names  []string
	values map[string]string
}

func newEnv() *orderedEnv { return &orderedEnv{values: map[string]string{}} }

func (e *orderedEnv) set(k, v string) {
	if _, ok := e.values[k]; !ok {
		e.names = append(e.names, k)
	}
	e.values[k] = v
}

func (e *orderedEnv) list() []string {
	out := make([]string, 0, len(e.names))
	for _, k := range e.names {
		out = append(out, k+"="+e.values[k])
	}
	return out
}

// stringMap is an object field as name/value pairs (values as Python's str() of them),
// sorted by name; nothing if it is not an object.
func stringMap(h wire.Header, key string) [][2]string {
	raw, ok := h.Raw(key)
	if !ok {
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil
	}
	out := make([][2]string, 0, len(m))
	for k, v := range m {
		out = append(out, [2]string{k, wire.PyStr(v)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}
