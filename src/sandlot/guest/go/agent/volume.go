package main

// Volumes: a FUSE filesystem at a mount path whose operations the agent forwards to the host
// over the agent channel (guest -> host requests, `vreq` frames; docs/guest-protocol.md,
// "Volumes"). The host serves them from the volume's directory. Everything the mount needs
// on this side is in the guest (the kernel's FUSE connection, this table of paths): a
// snapshot, a fork or a restore carries it, and requests a snapshot caught unanswered are
// sent again to the next host session.
//
// The filesystem is path based: a node is a path relative to the volume's root, and every
// request names it, so the host keeps no state between requests.

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"sandlot/guest/wire"
)

const (
	// Why 1 MiB: each read or write is one round trip to the host; the kernel's default of
	// 32 pages (128 KiB) made big files 8 round trips per MiB. 256 pages is its largest.
	fuseMaxWrite   = 1 << 20
	fuseAttrValid  = 1 // seconds the kernel caches an entry or attributes (other sandboxes write too)
	volCallTimeout = 20 * time.Second
	volResendAfter = 10 * time.Second
	sysFinitModule = 313 // amd64
)

// FUSE opcodes (linux/fuse.h).
const (
	fLookup      = 1
	fForget      = 2
	fGetattr     = 3
	fSetattr     = 4
	fMknod       = 8
	fMkdir       = 9
	fUnlink      = 10
	fRmdir       = 11
	fRename      = 12
	fOpen        = 14
	fRead        = 15
	fWrite       = 16
	fStatfs      = 17
	fRelease     = 18
	fFsync       = 20
	fFlush       = 25
	fInit        = 26
	fOpendir     = 27
	fReaddir     = 28
	fReleasedir  = 29
	fFsyncdir    = 30
	fInterrupt   = 36
	fDestroy     = 38
	fCreate      = 35
	fBatchForget = 42
)

// ---- guest -> host calls -----------------------------------------------------------------

type volReply struct {
	h       wire.Header
	payload []byte
}

type volCall struct {
	header  map[string]any
	payload []byte
	sent    time.Time
	done    chan volReply
}

type volCalls struct {
	mu      sync.Mutex
	next    int64
	pending map[int64]*volCall
}

// call sends one request to the host and waits for its answer; unanswered requests are sent
// again at each new session (a restore, a host that reconnected) and every volResendAfter.
func (a *agent) volCall(header map[string]any, payload []byte) (volReply, error) {
	v := &a.vol
	v.mu.Lock()
	if v.pending == nil {
		v.pending = map[int64]*volCall{}
	}
	v.next++
	id := v.next
	header["vreq"] = id
	c := &volCall{header: header, payload: payload, sent: time.Now(), done: make(chan volReply, 1)}
	v.pending[id] = c
	v.mu.Unlock()
	defer func() {
		v.mu.Lock()
		delete(v.pending, id)
		v.mu.Unlock()
	}()
	a.ch.send(header, payload)
	ticker := time.NewTicker(volResendAfter)
	defer ticker.Stop()
	deadline := time.Now().Add(volCallTimeout)
	for {
		select {
		case r := <-c.done:
			return r, nil
		case <-ticker.C:
			// Why: a host away (paused, restoring) answers nothing; keep asking, as a
			// hard NFS mount does, but give the caller EIO after a while.
			if time.Now().After(deadline) {
				return volReply{}, syscall.EIO
			}
			a.ch.send(header, payload)
		}
	}
}

// volAnswer takes a host's answer to a vreq.
func (a *agent) volAnswer(h wire.Header, payload []byte) {
	id, _, err := h.Int("vreq")
	if err != nil {
		return
	}
	a.vol.mu.Lock()
	c := a.vol.pending[id]
	a.vol.mu.Unlock()
	if c != nil {
		select {
		case c.done <- volReply{h, payload}:
		default:
		}
	}
}

// volResend sends the unanswered requests again (a new host session: they may be lost).
func (a *agent) volResend() {
	a.vol.mu.Lock()
	calls := make([]*volCall, 0, len(a.vol.pending))
	for _, c := range a.vol.pending {
		calls = append(calls, c)
	}
	a.vol.mu.Unlock()
	go func() {
		for _, c := range calls {
			a.ch.send(c.header, c.payload)
		}
	}()
}

// ---- mount ---------------------------------------------------------------------------------

type volMount struct {
	a        *agent
	fd       int
	token    string
	uid, gid uint32
	mu       sync.Mutex
	paths    map[uint64]string // node id -> path relative to the volume's root ("" the root)
	ids      map[string]uint64
	lookups  map[uint64]uint64
	nextNode uint64
}

// opMount mounts a volume at `path`: `token` is the host's capability for it, files appear
// owned by `user`.
func (a *agent) opMount(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, ok := h.Str("path")
	if !ok || !filepath.IsAbs(path) || filepath.Clean(path) != path || path == "/" {
		return nil, invalid("path must be a clean absolute path other than /")
	}
	token, ok := h.Str("token")
	if !ok || token == "" {
		return nil, invalid("token must be a string")
	}
	ids, err := userIDs(h)
	if err != nil {
		return nil, err
	}
	var uid, gid uint32
	if ids != nil {
		uid, gid = uint32(ids[0]), uint32(ids[1])
	}
	if err := loadFuse(); err != nil {
		return nil, &agentError{"internal", "cannot load fuse: " + err.Error()}
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		return nil, err
	}
	fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,"+
		"default_permissions", fd)
	if err := syscall.Mount("sandlot", path, "fuse.sandlot", syscall.MS_NOSUID|syscall.MS_NODEV,
		opts); err != nil {
		syscall.Close(fd)
		return nil, &os.PathError{Op: "mount", Path: path, Err: err}
	}
	m := &volMount{a: a, fd: fd, token: token, uid: uid, gid: gid, nextNode: 2,
		paths: map[uint64]string{1: ""}, ids: map[string]uint64{"": 1},
		lookups: map[uint64]uint64{}}
	go m.serve()
	return reply{}, nil
}

// loadFuse loads fuse.ko from the image's modules unless the kernel has FUSE already.
func loadFuse() error {
	if fs, err := os.ReadFile("/proc/filesystems"); err == nil &&
		strings.Contains(string(fs), "\tfuse\n") {
		return ensureFuseDev()
	}
	var u syscall.Utsname
	if err := syscall.Uname(&u); err != nil {
		return err
	}
	release := make([]byte, 0, len(u.Release))
	for _, c := range u.Release {
		if c == 0 {
			break
		}
		release = append(release, byte(c))
	}
	ko := "/lib/modules/" + string(release) + "/kernel/fs/fuse/fuse.ko"
	f, err := os.Open(ko)
	if err != nil {
		return err
	}
	defer f.Close()
	empty := []byte{0}
	_, _, errno := syscall.Syscall(sysFinitModule, f.Fd(),
		uintptr(unsafe.Pointer(&empty[0])), 0)
	if errno != 0 && errno != syscall.EEXIST {
		return &os.PathError{Op: "finit_module", Path: ko, Err: errno}
	}
	return ensureFuseDev()
}

func ensureFuseDev() error {
	if _, err := os.Stat("/dev/fuse"); err == nil {
		return nil
	}
	return syscall.Mknod("/dev/fuse", syscall.S_IFCHR|0o666, 10<<8|229)
}

func (m *volMount) serve() {
	buf := make([]byte, fuseMaxWrite+4096)
	for {
		n, err := syscall.Read(m.fd, buf)
		if err == syscall.EINTR || err == syscall.EAGAIN || err == syscall.ENOENT {
			continue
		}
		if err != nil || n < 40 {
			return // ENODEV: unmounted
		}
		req := make([]byte, n)
		copy(req, buf[:n])
		op := binary.LittleEndian.Uint32(req[4:])
		switch op {
		case fForget, fBatchForget, fInterrupt:
			m.forget(op, req)
			continue
		}
		go m.handle(req)
	}
}

// reply writes one answer: errno 0 with the body, or the error alone.
func (m *volMount) reply(unique uint64, errno syscall.Errno, body ...[]byte) {
	size := 16
	if errno == 0 {
		for _, b := range body {
			size += len(b)
		}
	}
	out := make([]byte, 16, size)
	binary.LittleEndian.PutUint32(out[0:], uint32(size))
	binary.LittleEndian.PutUint32(out[4:], uint32(-int32(errno)))
	binary.LittleEndian.PutUint64(out[8:], unique)
	if errno == 0 {
		for _, b := range body {
			out = append(out, b...)
		}
	}
	syscall.Write(m.fd, out)
}

func (m *volMount) forget(op uint32, req []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	le := binary.LittleEndian
	switch op {
	case fForget:
		if len(req) >= 48 {
			m.drop(le.Uint64(req[16:]), le.Uint64(req[40:]))
		}
	case fBatchForget:
		if len(req) < 48 {
			return
		}
		count := int(le.Uint32(req[40:]))
		for i := 0; i < count && 48+16*(i+1) <= len(req); i++ {
			e := req[48+16*i:]
			m.drop(le.Uint64(e), le.Uint64(e[8:]))
		}
	}
}

func (m *volMount) drop(node, n uint64) {
	if node == 1 {
		return
	}
	if m.lookups[node] <= n {
		delete(m.lookups, node)
		delete(m.ids, m.paths[node])
		delete(m.paths, node)
		return
	}
	m.lookups[node] -= n
}

func (m *volMount) path(node uint64) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, ok := m.paths[node]
	return p, ok
}

// remember gives path a node id (one more lookup of it).
func (m *volMount) remember(path string) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	id, ok := m.ids[path]
	if !ok {
		id = m.nextNode
		m.nextNode++
		m.ids[path] = id
		m.paths[id] = path
	}
	m.lookups[id]++
	return id
}

// renamed moves the ids of a path and everything under it.
func (m *volMount) renamed(from, to string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, p := range m.paths {
		if p == from || strings.HasPrefix(p, from+"/") {
			np := to + p[len(from):]
			delete(m.ids, p)
			m.paths[id] = np
			m.ids[np] = id
		}
	}
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// cstr is the NUL-terminated name at the start of b, and what follows it.
func cstr(b []byte) (string, []byte, bool) {
	for i, c := range b {
		if c == 0 {
			return string(b[:i]), b[i+1:], true
		}
	}
	return "", nil, false
}

// host sends one operation on the volume to the host.
func (m *volMount) host(fop string, fields map[string]any, payload []byte) (volReply, syscall.Errno) {
	header := map[string]any{"op": "vol", "fop": fop, "token": m.token}
	for k, v := range fields {
		header[k] = v
	}
	r, err := m.a.volCall(header, payload)
	if err != nil {
		return r, syscall.EIO
	}
	if e, ok, _ := r.h.Int("errno"); ok {
		if e <= 0 || e > 4095 {
			return r, syscall.EIO
		}
		return r, syscall.Errno(e)
	}
	return r, 0
}

type hostAttr struct {
	Mode  uint32 `json:"mode"`
	Size  uint64 `json:"size"`
	Mtime int64  `json:"mtime_ns"`
	Atime int64  `json:"atime_ns"`
	Ctime int64  `json:"ctime_ns"`
	Nlink uint32 `json:"nlink"`
}

func (m *volMount) attrOf(r volReply) (hostAttr, syscall.Errno) {
	var at hostAttr
	raw, ok := r.h.Raw("attr")
	if !ok || json.Unmarshal(raw, &at) != nil {
		return at, syscall.EIO
	}
	return at, 0
}

// fuseAttr is struct fuse_attr (88 bytes).
func (m *volMount) fuseAttr(node uint64, at hostAttr) []byte {
	b := make([]byte, 88)
	le := binary.LittleEndian
	le.PutUint64(b[0:], node)
	le.PutUint64(b[8:], at.Size)
	le.PutUint64(b[16:], (at.Size+511)/512)
	le.PutUint64(b[24:], uint64(at.Atime/1e9))
	le.PutUint64(b[32:], uint64(at.Mtime/1e9))
	le.PutUint64(b[40:], uint64(at.Ctime/1e9))
	le.PutUint32(b[48:], uint32(at.Atime%1e9))
	le.PutUint32(b[52:], uint32(at.Mtime%1e9))
	le.PutUint32(b[56:], uint32(at.Ctime%1e9))
	le.PutUint32(b[60:], at.Mode)
	nlink := at.Nlink
	if nlink == 0 {
		nlink = 1
	}
	le.PutUint32(b[64:], nlink)
	le.PutUint32(b[68:], m.uid)
	le.PutUint32(b[72:], m.gid)
	le.PutUint32(b[80:], 4096)
	return b
}

// entryOut is struct fuse_entry_out for path (a new lookup of it).
func (m *volMount) entryOut(path string, at hostAttr) []byte {
	node := m.remember(path)
	b := make([]byte, 40)
	le := binary.LittleEndian
	le.PutUint64(b[0:], node)
	le.PutUint64(b[16:], fuseAttrValid)
	le.PutUint64(b[24:], fuseAttrValid)
	return append(b, m.fuseAttr(node, at)...)
}

func (m *volMount) attrOut(node uint64, at hostAttr) []byte {
	b := make([]byte, 16)
	binary.LittleEndian.PutUint64(b, fuseAttrValid)
	return append(b, m.fuseAttr(node, at)...)
}

func openOut() []byte {
	b := make([]byte, 16)
	binary.LittleEndian.PutUint32(b[8:], 1) // FOPEN_DIRECT_IO: other sandboxes write too
	return b
}

func (m *volMount) handle(req []byte) {
	le := binary.LittleEndian
	op := le.Uint32(req[4:])
	unique := le.Uint64(req[8:])
	node := le.Uint64(req[16:])
	in := req[40:]
	defer func() {
		if recover() != nil {
			m.reply(unique, syscall.EIO)
		}
	}()
	if op == fInit {
		m.init(unique, in)
		return
	}
	if op == fDestroy {
		return
	}
	path, known := m.path(node)
	if !known {
		m.reply(unique, syscall.ESTALE)
		return
	}
	switch op {
	case fLookup:
		name, _, ok := cstr(in)
		if !ok {
			m.reply(unique, syscall.EINVAL)
			return
		}
		m.entry(unique, "stat", join(path, name), nil)
	case fGetattr:
		r, e := m.host("stat", map[string]any{"path": path}, nil)
		m.attrReply(unique, node, r, e)
	case fSetattr:
		if len(in) < 88 {
			m.reply(unique, syscall.EINVAL)
			return
		}
		valid := le.Uint32(in[0:])
		f := map[string]any{"path": path}
		if valid&1 != 0 {
			f["mode"] = le.Uint32(in[68:]) & 0o7777
		}
		if valid&8 != 0 {
			f["size"] = le.Uint64(in[16:])
		}
		if valid&(16|128) != 0 {
			f["atime_ns"] = int64(le.Uint64(in[32:]))*1e9 + int64(le.Uint32(in[56:]))
			if valid&128 != 0 {
				f["atime_ns"] = "now"
			}
		}
		if valid&(32|256) != 0 {
			f["mtime_ns"] = int64(le.Uint64(in[40:]))*1e9 + int64(le.Uint32(in[60:]))
			if valid&256 != 0 {
				f["mtime_ns"] = "now"
			}
		}
		// uid/gid: everything belongs to the mount's user; a chown is accepted and ignored.
		r, e := m.host("setattr", f, nil)
		m.attrReply(unique, node, r, e)
	case fMkdir, fMknod, fCreate:
		var mode uint32
		var rest []byte
		switch op {
		case fMkdir:
			if len(in) < 8 {
				m.reply(unique, syscall.EINVAL)
				return
			}
			mode, rest = le.Uint32(in)&^le.Uint32(in[4:]), in[8:]
		case fMknod:
			if len(in) < 16 {
				m.reply(unique, syscall.EINVAL)
				return
			}
			mode, rest = le.Uint32(in)&^le.Uint32(in[8:]), in[16:]
			if mode&syscall.S_IFMT != syscall.S_IFREG {
				m.reply(unique, syscall.EPERM)
				return
			}
		default:
			if len(in) < 16 {
				m.reply(unique, syscall.EINVAL)
				return
			}
			mode, rest = le.Uint32(in[4:])&^le.Uint32(in[8:]), in[16:]
		}
		name, _, ok := cstr(rest)
		if !ok {
			m.reply(unique, syscall.EINVAL)
			return
		}
		fop := "create"
		if op == fMkdir {
			fop = "mkdir"
		}
		f := map[string]any{"mode": mode & 0o7777}
		if op == fCreate && le.Uint32(in)&syscall.O_EXCL != 0 {
			f["excl"] = true
		}
		if op == fCreate {
			m.entry(unique, fop, join(path, name), f, openOut())
		} else {
			m.entry(unique, fop, join(path, name), f)
		}
	case fUnlink, fRmdir:
		name, _, ok := cstr(in)
		if !ok {
			m.reply(unique, syscall.EINVAL)
			return
		}
		fop := "unlink"
		if op == fRmdir {
			fop = "rmdir"
		}
		_, e := m.host(fop, map[string]any{"path": join(path, name)}, nil)
		m.reply(unique, e)
	case fRename:
		if len(in) < 8 {
			m.reply(unique, syscall.EINVAL)
			return
		}
		newDir, known := m.path(le.Uint64(in))
		from, rest, ok1 := cstr(in[8:])
		to, _, ok2 := cstr(rest)
		if !known || !ok1 || !ok2 {
			m.reply(unique, syscall.EINVAL)
			return
		}
		src, dst := join(path, from), join(newDir, to)
		_, e := m.host("rename", map[string]any{"path": src, "to": dst}, nil)
		if e == 0 {
			m.renamed(src, dst)
		}
		m.reply(unique, e)
	case fOpen, fOpendir:
		m.reply(unique, 0, openOut())
	case fRead:
		if len(in) < 24 {
			m.reply(unique, syscall.EINVAL)
			return
		}
		size := le.Uint32(in[16:])
		if size > fuseMaxWrite {
			size = fuseMaxWrite
		}
		r, e := m.host("read", map[string]any{"path": path, "offset": le.Uint64(in[8:]),
			"size": size}, nil)
		if len(r.payload) > int(size) {
			e = syscall.EIO
		}
		m.reply(unique, e, r.payload)
	case fWrite:
		if len(in) < 40 {
			m.reply(unique, syscall.EINVAL)
			return
		}
		size := le.Uint32(in[16:])
		data := in[40:]
		if int(size) > len(data) {
			m.reply(unique, syscall.EINVAL)
			return
		}
		_, e := m.host("write", map[string]any{"path": path, "offset": le.Uint64(in[8:])},
			data[:size])
		out := make([]byte, 8)
		le.PutUint32(out, size)
		m.reply(unique, e, out)
	case fReaddir:
		m.readdir(unique, path, in)
	case fStatfs:
		r, e := m.host("statfs", map[string]any{"path": path}, nil)
		out := make([]byte, 80)
		for i, k := range []string{"blocks", "bfree", "bavail", "files", "ffree"} {
			v, _, _ := r.h.Int(k)
			le.PutUint64(out[8*i:], uint64(v))
		}
		le.PutUint32(out[40:], 4096)
		le.PutUint32(out[44:], 255)
		le.PutUint32(out[48:], 4096)
		m.reply(unique, e, out)
	case fRelease, fReleasedir, fFlush, fFsync, fFsyncdir:
		m.reply(unique, 0)
	default:
		m.reply(unique, syscall.ENOSYS)
	}
}

func (m *volMount) init(unique uint64, in []byte) {
	le := binary.LittleEndian
	if len(in) < 8 {
		m.reply(unique, syscall.EINVAL)
		return
	}
	minor := le.Uint32(in[4:])
	if minor > 31 {
		minor = 31
	}
	out := make([]byte, 64)
	le.PutUint32(out[0:], 7)
	le.PutUint32(out[4:], minor)
	flags := uint32(1 | 32) // FUSE_ASYNC_READ, FUSE_BIG_WRITES
	if minor >= 28 {
		flags |= 1 << 22 // FUSE_MAX_PAGES: max_pages below counts (else 32 pages at most)
	}
	le.PutUint32(out[8:], fuseMaxWrite) // max_readahead
	le.PutUint32(out[12:], flags)
	le.PutUint16(out[16:], 12) // max_background
	le.PutUint16(out[18:], 9)  // congestion_threshold
	le.PutUint32(out[20:], fuseMaxWrite)
	le.PutUint32(out[24:], 1)                 // time_gran
	le.PutUint16(out[28:], fuseMaxWrite/4096) // max_pages
	m.reply(unique, 0, out)
}

func (m *volMount) attrReply(unique, node uint64, r volReply, e syscall.Errno) {
	if e != 0 {
		m.reply(unique, e)
		return
	}
	at, e := m.attrOf(r)
	if e != 0 {
		m.reply(unique, e)
		return
	}
	m.reply(unique, 0, m.attrOut(node, at))
}

// entry runs fop on path and answers with the entry it names (then extra).
func (m *volMount) entry(unique uint64, fop, path string, f map[string]any, extra ...[]byte) {
	if f == nil {
		f = map[string]any{}
	}
	f["path"] = path
	r, e := m.host(fop, f, nil)
	if e != 0 {
		m.reply(unique, e)
		return
	}
	at, e := m.attrOf(r)
	if e != 0 {
		m.reply(unique, e)
		return
	}
	m.reply(unique, 0, append([][]byte{m.entryOut(path, at)}, extra...)...)
}

// readdir answers from the host's listing, starting at entry number `offset`.
func (m *volMount) readdir(unique uint64, path string, in []byte) {
	le := binary.LittleEndian
	if len(in) < 24 {
		m.reply(unique, syscall.EINVAL)
		return
	}
	offset := le.Uint64(in[8:])
	size := int(le.Uint32(in[16:]))
	r, e := m.host("list", map[string]any{"path": path, "offset": offset}, nil)
	if e != 0 {
		m.reply(unique, e)
		return
	}
	var entries []struct {
		Name string `json:"name"`
		Type uint32 `json:"type"`
	}
	if raw, ok := r.h.Raw("entries"); !ok || json.Unmarshal(raw, &entries) != nil {
		m.reply(unique, syscall.EIO)
		return
	}
	out := make([]byte, 0, size)
	for i, ent := range entries {
		if ent.Name == "" || strings.ContainsAny(ent.Name, "/\x00") {
			continue
		}
		rec := 24 + (len(ent.Name)+7)&^7
		if len(out)+rec > size {
			break
		}
		b := make([]byte, rec)
		le.PutUint64(b[0:], 0xffffffff) // unknown inode: the kernel looks the name up
		le.PutUint64(b[8:], offset+uint64(i)+1)
		le.PutUint32(b[16:], uint32(len(ent.Name)))
		le.PutUint32(b[20:], ent.Type)
		copy(b[24:], ent.Name)
		out = append(out, b...)
	}
	m.reply(unique, 0, out)
}
