package main

import (
	"bytes"
	"os"
	"strings"
	"syscall"
	"unsafe"
)

// metadataPrefix: a file's user metadata are extended attributes, as E2B's envd keeps them.
const metadataPrefix = "user.e2b."

// writeMetadata sets metadata as `user.e2b.<key>` extended attributes; a file system without
// user xattrs (tmpfs before Linux 6.6) keeps none, and the answer's entry, read back, says so.
func writeMetadata(path string, metadata [][2]string) error {
	for _, kv := range metadata {
		err := syscall.Setxattr(path, metadataPrefix+strings.ToLower(kv[0]), []byte(kv[1]), 0)
		if err == syscall.ENOTSUP || err == syscall.EOPNOTSUPP {
			return nil
		}
		if err != nil {
			return &os.PathError{Op: "setxattr", Path: path, Err: err}
		}
	}
	return nil
}

// readMetadata is a file's `user.e2b.*` attributes (symlinks not followed); none on error.
func readMetadata(path string) map[string]string {
	names, err := xattrCall(syscall.SYS_LLISTXATTR, path, "")
	if err != nil || len(names) == 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range bytes.Split(bytes.TrimRight(names, "\x00"), []byte{0}) {
		key := string(name)
		if !strings.HasPrefix(key, metadataPrefix) {
			continue
		}
		value, err := xattrCall(syscall.SYS_LGETXATTR, path, key)
		if err != nil {
			return nil
		}
		out[key[len(metadataPrefix):]] = strings.ToValidUTF8(string(value), "\uFFFD")
	}
	return out
}

// xattrCall runs llistxattr (name "") or lgetxattr, growing its buffer as needed.
func xattrCall(trap uintptr, path, name string) ([]byte, error) {
	p, err := syscall.BytePtrFromString(path)
	if err != nil {
		return nil, err
	}
	var n *byte
	if trap == syscall.SYS_LGETXATTR {
		if n, err = syscall.BytePtrFromString(name); err != nil {
			return nil, err
		}
	}
	for size := 1024; size <= 1<<20; size *= 4 {
		buf := make([]byte, size)
		var r uintptr
		var errno syscall.Errno
		if trap == syscall.SYS_LGETXATTR {
			r, _, errno = syscall.Syscall6(trap, uintptr(unsafe.Pointer(p)),
				uintptr(unsafe.Pointer(n)), uintptr(unsafe.Pointer(&buf[0])), uintptr(size), 0, 0)
		} else {
			r, _, errno = syscall.Syscall(trap, uintptr(unsafe.Pointer(p)),
				uintptr(unsafe.Pointer(&buf[0])), uintptr(size))
		}
		if errno == syscall.ERANGE {
			continue
		}
		if errno != 0 {
			return nil, errno
		}
		return buf[:r], nil
	}
	return nil, syscall.ERANGE
}
