package main

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"sandlot/guest/wire"
)

// The image's /etc/passwd and /etc/group, read directly (a static binary has no NSS), and
// cached until the file changes.

type passwdEntry struct {
	name string
	uid  int
	gid  int
	dir  string
}

type fileCache struct {
	mu    sync.Mutex
	path  string
	stamp [3]int64 // mtime s, ns, size
	lines [][]string
}

var (
	passwdFile = &fileCache{path: "/etc/passwd"}
	groupFile  = &fileCache{path: "/etc/group"}
)

// records is the file's colon-separated lines, re-read when its mtime or size changed.
func (c *fileCache) records() [][]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var st syscall.Stat_t
	if err := syscall.Stat(c.path, &st); err != nil {
		c.lines = nil
		c.stamp = [3]int64{}
		return nil
	}
	stamp := [3]int64{st.Mtim.Sec, st.Mtim.Nsec, st.Size}
	if stamp == c.stamp && c.lines != nil {
		return c.lines
	}
	f, err := os.Open(c.path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var lines [][]string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		lines = append(lines, strings.Split(line, ":"))
	}
	c.lines, c.stamp = lines, stamp
	return lines
}

func parsePasswd(rec []string) (passwdEntry, bool) {
	if len(rec) < 7 {
		return passwdEntry{}, false
	}
	uid, err1 := strconv.Atoi(rec[2])
	gid, err2 := strconv.Atoi(rec[3])
	if err1 != nil || err2 != nil {
		return passwdEntry{}, false
	}
	return passwdEntry{name: rec[0], uid: uid, gid: gid, dir: rec[5]}, true
}

func userByName(name string) (passwdEntry, bool) {
	for _, rec := range passwdFile.records() {
		if rec[0] == name {
			return parsePasswd(rec)
		}
	}
	return passwdEntry{}, false
}

func userByUID(uid int) (passwdEntry, bool) {
	want := strconv.Itoa(uid)
	for _, rec := range passwdFile.records() {
		if len(rec) > 2 && rec[2] == want {
			return parsePasswd(rec)
		}
	}
	return passwdEntry{}, false
}

// supplementaryGroups is the groups that list `name` as a member (not its primary group).
func supplementaryGroups(name string) []uint32 {
	out := []uint32{}
	for _, rec := range groupFile.records() {
		if len(rec) < 4 {
			continue
		}
		for _, member := range strings.Split(rec[3], ",") {
			if member == name {
				if gid, err := strconv.Atoi(rec[2]); err == nil {
					out = append(out, uint32(gid))
				}
				break
			}
		}
	}
	return out
}

// userIDs is the owner to give new files and directories; nil for root (or no user).
func userIDs(h wire.Header) (*[2]int, error) {
	user, isStr := h.Str("user")
	if !h.Truthy("user") || (isStr && user == "root") {
		return nil, nil
	}
	if !isStr {
		return nil, invalid("no such user: %s", wire.PyStr(h["user"]))
	}
	pw, ok := userByName(user)
	if !ok {
		return nil, invalid("no such user: %s", user)
	}
	return &[2]int{pw.uid, pw.gid}, nil
}
