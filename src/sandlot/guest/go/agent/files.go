package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"sandlot/guest/wire"
)

// needPath is an absolute path field, normalized as posixpath.normpath does.
func needPath(h wire.Header, key string) (string, error) {
	path, ok := h.Str(key)
	if !ok || !strings.HasPrefix(path, "/") || strings.ContainsRune(path, 0) {
		return "", invalid("%s must be an absolute path", key)
	}
	clean := filepath.Clean(path)
	if strings.HasPrefix(path, "//") && !strings.HasPrefix(path, "///") && clean != "/" {
		clean = "/" + clean // POSIX keeps exactly two leading slashes
	}
	return clean, nil
}

func pathErr(op, path string, err error) error {
	if err == nil {
		return nil
	}
	return &os.PathError{Op: op, Path: path, Err: err}
}

// entry describes one file system entry (symlinks not followed).
func entry(path string) (map[string]any, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return nil, pathErr("lstat", path, err)
	}
	kind := "other"
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		kind = "dir"
	case syscall.S_IFLNK:
		kind = "symlink"
	case syscall.S_IFREG:
		kind = "file"
	}
	owner := strconv.Itoa(int(st.Uid))
	if pw, ok := userByUID(int(st.Uid)); ok {
		owner = pw.name
	}
	name := filepath.Base(path)
	if path == "/" || path == "//" {
		name = "/"
	}
	out := map[string]any{
		"name": name, "path": path, "type": kind, "size": st.Size,
		"mode":  st.Mode & 0o7777,
		"owner": owner,
		"mtime": float64(st.Mtim.Sec) + float64(st.Mtim.Nsec)/1e9,
	}
	if kind == "symlink" {
		target, err := os.Readlink(path)
		if err != nil {
			return nil, err
		}
		out["target"] = target
	} else if metadata := readMetadata(path); len(metadata) > 0 {
		out["metadata"] = metadata
	}
	return out, nil
}

func (a *agent) opRead(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	if isDir(path) {
		return nil, invalid("%s: is a directory", path)
	}
	window, _, _ := h.Int("window")
	var c *credits
	if window > 0 {
		c = newCredits(window)
		a.setRead(rid, c)
	}
	defer a.dropRead(rid)
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	a.ch.send(map[string]any{"id": rid, "event": "begin", "size": st.Size()}, nil)
	buf := make([]byte, wire.ChunkSize) // send copies it into the frame
	for {
		if c != nil && !c.take() {
			return nil, invalid("read cancelled by the host")
		}
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			a.ch.send(map[string]any{"id": rid, "event": "data"}, buf[:n])
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	return reply{"end": true}, nil
}

// upload is a `write` in progress: its chunks arrive as frames of their own. The main loop
// hands them to the upload's goroutine, which does all its file system work: the main loop
// never waits on a file system (a volume's FUSE requests are answered through it).
type upload struct {
	frames chan uploadFrame
	done   chan struct{} // closed when the goroutine has finished
	cancel chan struct{} // closed when the session ended: drop the upload
	window bool          // the host waits for an `ack` event per chunk written
}

type uploadFrame struct {
	op      string // "chunk" or "end"
	payload []byte
}

type uploadSpec struct {
	path     string
	owner    *[2]int
	mode     *int64
	metadata [][2]string
}

func (a *agent) opWrite(rid int64, h wire.Header, payload []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	// Only the user's name is resolved here (/etc/passwd): nothing that may be a volume.
	owner, err := userIDs(h)
	if err != nil {
		return nil, err
	}
	spec := uploadSpec{path: path, owner: owner}
	if h.Has("mode") {
		if _, ok := h.Raw("mode"); ok {
			m, _, err := h.Int("mode")
			if err != nil {
				return nil, invalid("mode must be a number")
			}
			spec.mode = &m
		}
	}
	if h.Truthy("metadata") {
		if raw, _ := h.Raw("metadata"); raw[0] != '{' {
			return nil, invalid("metadata must be an object of strings")
		}
		spec.metadata = stringMap(h, "metadata")
	}
	window, _, _ := h.Int("window")
	// Why 64: with `window` the host sends at most that many chunks ahead; an older host
	// that does not fills it and then waits, as before uploads had goroutines.
	up := &upload{frames: make(chan uploadFrame, 64), done: make(chan struct{}),
		cancel: make(chan struct{}), window: window > 0}
	a.uploadsMu.Lock()
	a.uploads[rid] = up
	a.uploadsMu.Unlock()
	first := append([]byte(nil), payload...)
	go a.runUpload(rid, up, spec, first)
	if h.Truthy("eof") {
		a.uploadFrame(rid, up, "end", nil)
	}
	return nil, nil
}

// uploadFrame queues a frame of an upload for its goroutine (waits while its queue is full,
// unless the upload has ended).
func (a *agent) uploadFrame(rid int64, up *upload, op string, payload []byte) {
	select {
	case up.frames <- uploadFrame{op, payload}:
	case <-up.done:
	case <-up.cancel:
	}
}

func (a *agent) runUpload(rid int64, up *upload, spec uploadSpec, first []byte) {
	var f *os.File
	tmp := spec.path + ".sandlot-" + strconv.FormatInt(rid, 10) + ".tmp"
	finish := func() {
		a.uploadsMu.Lock()
		if a.uploads[rid] == up {
			delete(a.uploads, rid)
		}
		a.uploadsMu.Unlock()
		close(up.done)
	}
	// The error is answered before the upload is forgotten: until then the host's further
	// chunks still find it (and are dropped); after, the main loop answers them "unknown op",
	// which must not reach the host ahead of the reason.
	refuse := func(kind, msg string) {
		a.replyError(rid, kind, msg)
		finish()
	}
	fail := func(err error) {
		if f != nil {
			f.Close()
			os.Remove(tmp)
		}
		var errno syscall.Errno
		msg := err.Error()
		if errors.As(err, &errno) {
			msg = strerror(errno)
		}
		refuse("invalid", spec.path+": "+msg)
	}
	if isDir(spec.path) {
		refuse("invalid", spec.path+": is a directory")
		return
	}
	if err := makeDirs(filepath.Dir(spec.path), spec.owner); err != nil {
		refuse(errorKind(err))
		return
	}
	var err error
	f, err = os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		refuse(errorKind(err))
		return
	}
	if len(first) > 0 {
		if _, err := f.Write(first); err != nil {
			fail(err)
			return
		}
	}
	for {
		var fr uploadFrame
		select {
		case fr = <-up.frames:
		case <-up.cancel:
			f.Close()
			os.Remove(tmp)
			finish()
			return
		}
		if fr.op == "chunk" {
			if _, err := f.Write(fr.payload); err != nil {
				fail(err)
				return
			}
			if up.window {
				a.ch.send(map[string]any{"id": rid, "event": "ack"}, nil)
			}
			continue
		}
		// end
		err := func() error {
			if err := f.Close(); err != nil {
				return err
			}
			if spec.mode != nil {
				if err := syscall.Chmod(tmp, uint32(*spec.mode)); err != nil {
					return pathErr("chmod", tmp, err)
				}
			}
			if spec.owner != nil {
				if err := os.Chown(tmp, spec.owner[0], spec.owner[1]); err != nil {
					return err
				}
			}
			// A new file each time: an overwrite replaces the whole metadata set.
			if err := writeMetadata(tmp, spec.metadata); err != nil {
				return err
			}
			if err := syscall.Rename(tmp, spec.path); err != nil {
				return pathErr("rename", tmp, err)
			}
			return nil
		}()
		if err != nil {
			f = nil // closed
			os.Remove(tmp)
			fail(err)
			return
		}
		finish()
		e, err := entry(spec.path)
		if err != nil {
			kind, msg := errorKind(err)
			a.replyError(rid, kind, msg)
			return
		}
		e["id"] = rid
		e["ok"] = true
		a.ch.send(e, nil)
		return
	}
}

// dropUploads forgets the uploads of a session that ended.
func (a *agent) dropUploads() {
	a.uploadsMu.Lock()
	old := a.uploads
	a.uploads = map[int64]*upload{}
	a.uploadsMu.Unlock()
	for _, up := range old {
		close(up.cancel)
	}
}

func (a *agent) opList(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	depth := int64(1)
	if h.Truthy("depth") {
		if depth, _, err = h.Int("depth"); err != nil {
			return nil, invalid("depth must be a number")
		}
	}
	if depth < 1 {
		depth = 1
	}
	limit := int64(maxListEntries)
	if h.Truthy("max_entries") {
		if limit, _, err = h.Int("max_entries"); err != nil {
			return nil, invalid("max_entries must be a number")
		}
	}
	if limit < 1 {
		limit = 1
	}
	if limit > maxListEntries {
		limit = maxListEntries
	}
	if !isDir(path) {
		if _, err := os.Lstat(path); err != nil {
			return nil, pathErr("list", path, syscall.ENOENT)
		}
		return nil, invalid("%s: not a directory", path)
	}
	w := &walker{limit: int(limit), out: []map[string]any{}}
	if err := w.walk(path, int(depth)); err != nil {
		return nil, err
	}
	return reply{"entries": w.out}, nil
}

type walker struct {
	out   []map[string]any
	size  int
	limit int
}

func (w *walker) walk(path string, depth int) error {
	d, err := os.Open(path)
	if err != nil {
		if skippable(err) {
			return nil
		}
		return err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		if skippable(err) {
			return nil
		}
		return err
	}
	sort.Strings(names)
	for _, name := range names {
		full := filepath.Join(path, name)
		e, err := entry(full)
		if err != nil {
			continue
		}
		w.out = append(w.out, e)
		encoded, _ := json.Marshal(e)
		w.size += len(encoded) + 1
		if len(w.out) > w.limit || w.size > listReplyBytes {
			return invalid("listing too large: more than %d entries; list a subdirectory "+
				"or a smaller depth", len(w.out)-1)
		}
		if depth > 1 && e["type"] == "dir" {
			if err := w.walk(full, depth-1); err != nil {
				return err
			}
		}
	}
	return nil
}

// skippable: a directory the walk cannot read is left out, as it was.
func skippable(err error) bool {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	return errno == syscall.EACCES || errno == syscall.EPERM || errno == syscall.ENOTDIR ||
		errno == syscall.ENOENT
}

func (a *agent) opStat(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	return entry(path)
}

func (a *agent) opExists(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	_, err = os.Lstat(path)
	return reply{"exists": err == nil}, nil
}

func (a *agent) opRemove(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	if st, err := os.Lstat(path); err == nil && st.IsDir() {
		if err := os.RemoveAll(path); err != nil {
			return nil, err
		}
		return reply{}, nil
	}
	if err := syscall.Unlink(path); err != nil {
		return nil, pathErr("unlink", path, err)
	}
	return reply{}, nil
}

func (a *agent) opMkdir(rid int64, h wire.Header, _ []byte) (reply, error) {
	path, err := needPath(h, "path")
	if err != nil {
		return nil, err
	}
	owner, err := userIDs(h)
	if err != nil {
		return nil, err
	}
	existed := isDir(path)
	if err := makeDirs(path, owner); err != nil {
		return nil, err
	}
	e, err := entry(path)
	if err != nil {
		return nil, err
	}
	e["created"] = !existed
	return e, nil
}

func (a *agent) opRename(rid int64, h wire.Header, _ []byte) (reply, error) {
	src, err := needPath(h, "src")
	if err != nil {
		return nil, err
	}
	dst, err := needPath(h, "dst")
	if err != nil {
		return nil, err
	}
	if err := syscall.Rename(src, dst); err != nil {
		return nil, &os.LinkError{Op: "rename", Old: src, New: dst, Err: err}
	}
	return entry(dst)
}

// makeDirs makes path and its missing parents, given to owner if not nil.
func makeDirs(path string, owner *[2]int) error {
	var missing []string
	for p := path; p != "" && !isDir(p); {
		missing = append(missing, p)
		parent := filepath.Dir(p)
		if parent == p {
			break
		}
		p = parent
	}
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		if err := syscall.Mkdir(d, 0o777); err != nil {
			return pathErr("mkdir", d, err)
		}
		if owner != nil {
			if err := os.Chown(d, owner[0], owner[1]); err != nil {
				return err
			}
		}
	}
	return nil
}
