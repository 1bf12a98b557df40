package main

import (
	"bufio"
	"encoding/base64"
	"encoding/binary"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"sandlot/guest/wire"
)

func (a *agent) opHello(rid int64, h wire.Header, _ []byte) (reply, error) {
	a.procsMu.Lock()
	for _, p := range a.procs {
		p.mu.Lock()
		p.subscribers = map[int64]*credits{}
		p.mu.Unlock()
	}
	a.procsMu.Unlock()
	a.dropUploads()
	a.readsMu.Lock()
	old := a.reads
	a.reads = map[int64]*credits{}
	a.readsMu.Unlock()
	for _, c := range old { // the reader of the old session is gone
		c.give(-1)
	}
	a.volResend() // a new host: volumes' requests it never saw
	var nonce any
	if raw, ok := h["nonce"]; ok {
		nonce = raw
	}
	a.stateMu.Lock()
	generation := a.generation
	a.stateMu.Unlock()
	return reply{
		"hello":      map[string]any{"proto": protoVersion, "caps": caps, "nonce": nonce},
		"generation": generation,
	}, nil
}

func (a *agent) opPing(rid int64, h wire.Header, _ []byte) (reply, error) {
	return reply{"time_ns": time.Now().UnixNano()}, nil
}

// opStepClock moves the wall clock by delta_ns (the host measured the offset around a ping).
func (a *agent) opStepClock(rid int64, h wire.Header, _ []byte) (reply, error) {
	delta, ok, err := h.Int("delta_ns")
	if err != nil || !ok {
		return nil, invalid("delta_ns must be a number")
	}
	a.configureMu.Lock()
	err = setClock(time.Now().UnixNano() + delta)
	a.configureMu.Unlock()
	if err != nil {
		return nil, err
	}
	return reply{"time_ns": time.Now().UnixNano()}, nil
}

// opConfigure sets the clock, reseeds the RNG, updates the env and CPUs: sent after boot and
// restore. The host may send it twice (it re-sends with an unanswered hello): one at a time.
func (a *agent) opConfigure(rid int64, h wire.Header, _ []byte) (reply, error) {
	a.configureMu.Lock()
	defer a.configureMu.Unlock()
	if t, ok, err := h.Int("time_ns"); ok {
		if err != nil {
			return nil, invalid("time_ns must be a number")
		}
		if err := setClock(t); err != nil {
			return nil, err
		}
	}
	if h.Truthy("entropy") {
		s, _ := h.Str("entropy")
		data, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return nil, invalid("entropy: %v", err)
		}
		if err := reseed(data); err != nil {
			return nil, err
		}
	}
	if raw, ok := h.Raw("env"); ok && len(raw) > 0 && raw[0] == '{' {
		env := stringMap(h, "env")
		a.stateMu.Lock()
		a.env = env
		a.stateMu.Unlock()
	}
	if raw, ok := h.Raw("generation"); ok {
		generation := wire.PyStr(raw)
		a.stateMu.Lock()
		a.generation = generation
		a.stateMu.Unlock()
		if err := os.MkdirAll(runDir, 0o755); err != nil {
			return nil, err
		}
		tmp := runDir + "/generation." + strconv.FormatInt(rid, 10) + ".tmp"
		if err := os.WriteFile(tmp, []byte(generation+"\n"), 0o644); err != nil {
			return nil, err
		}
		if err := os.Rename(tmp, runDir+"/generation"); err != nil {
			return nil, err
		}
	}
	if h.Truthy("freeze") {
		// Before a template snapshot: collect now and give the freed pages back, so restored
		// sandboxes start with a small, settled heap (the Python agent froze its GC here).
		runtime.GC()
		debug.FreeOSMemory()
	}
	out := reply{"time_ns": time.Now().UnixNano()}
	if h.Truthy("disk_bytes") {
		n, _, err := h.Int("disk_bytes")
		if err != nil || n <= 0 {
			return nil, invalid("disk_bytes must be a positive number")
		}
		size, err := growRootFS(n, diskWait)
		if err != nil {
			return nil, err
		}
		out["disk_bytes"] = size
	}
	if h.Truthy("cpus") {
		n, _, err := h.Int("cpus")
		if err != nil {
			return nil, invalid("cpus must be a number")
		}
		setOnlineCPUs(int(n))
		out["cpus"], out["mem_kb"] = onlineCPUs(), memTotalKB()
	}
	out["time_ns"] = time.Now().UnixNano()
	return out, nil
}

// ext4's online resize: the new size in blocks (linux/ext4.h EXT4_IOC_RESIZE_FS).
const ext4ResizeFS = 0x40086610

var diskWait = 10 * time.Second

// growRootFS grows the root filesystem to fill its block device once the device is at least
// minBytes (the host grew it: the kernel learns the new capacity from the device's config
// interrupt, a moment later). Growing only; returns the filesystem's size in bytes.
func growRootFS(minBytes int64, wait time.Duration) (int64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat("/", &st); err != nil {
		return 0, os.NewSyscallError("stat /", err)
	}
	major, minor := (st.Dev>>8)&0xfff|(st.Dev>>32)&^0xfff, st.Dev&0xff|(st.Dev>>12)&^0xff
	sizePath := "/sys/dev/block/" + strconv.FormatUint(major, 10) + ":" +
		strconv.FormatUint(minor, 10) + "/size"
	deadline := time.Now().Add(wait)
	var device int64
	for {
		data, err := os.ReadFile(sizePath)
		if err != nil {
			return 0, err
		}
		sectors, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
		if err != nil {
			return 0, invalid("%s: %v", sizePath, err)
		}
		device = sectors * 512
		if device >= minBytes || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if device < minBytes {
		return 0, invalid("the disk is %d bytes, not the %d asked for", device, minBytes)
	}
	var fs syscall.Statfs_t
	if err := syscall.Statfs("/", &fs); err != nil {
		return 0, os.NewSyscallError("statfs /", err)
	}
	f, err := os.Open("/")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	blocks := uint64(device) / uint64(fs.Bsize)
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), ext4ResizeFS,
		uintptr(unsafe.Pointer(&blocks))); errno != 0 {
		return 0, os.NewSyscallError("EXT4_IOC_RESIZE_FS", errno)
	}
	return int64(blocks) * fs.Bsize, nil
}

func setClock(ns int64) error {
	ts := syscall.NsecToTimespec(ns)
	_, _, errno := syscall.Syscall(syscall.SYS_CLOCK_SETTIME, 0, /* CLOCK_REALTIME */
		uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return os.NewSyscallError("clock_settime", errno)
	}
	return nil
}

const (
	rndAddEntropy  = 0x40085203
	rndReseedCRNG  = 0x5207
	sysfsCPUs      = "/sys/devices/system/cpu"
	procMeminfo    = "/proc/meminfo"
	maxEntropySize = 1 << 16
)

// reseed mixes host entropy into the kernel CRNG and forces a reseed (forks share RNG state).
func reseed(entropy []byte) error {
	if len(entropy) > maxEntropySize {
		entropy = entropy[:maxEntropySize]
	}
	words := (len(entropy) + 3) / 4
	buf := make([]byte, 8+words*4) // struct rand_pool_info {int entropy_count; int buf_size; ...}
	binary.LittleEndian.PutUint32(buf[0:], uint32(len(entropy)*8))
	binary.LittleEndian.PutUint32(buf[4:], uint32(len(entropy)))
	copy(buf[8:], entropy)
	f, err := os.OpenFile("/dev/random", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fd := f.Fd()
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, rndAddEntropy,
		uintptr(unsafe.Pointer(&buf[0]))); errno != 0 {
		return os.NewSyscallError("RNDADDENTROPY", errno)
	}
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, rndReseedCRNG, 0); errno != 0 {
		return os.NewSyscallError("RNDRESEEDCRNG", errno)
	}
	return nil
}

// setOnlineCPUs onlines CPUs 0..count-1 and offlines the rest (cpu0 is always online).
func setOnlineCPUs(count int) {
	paths, _ := filepath.Glob(sysfsCPUs + "/cpu[0-9]*/online")
	for _, path := range paths {
		index, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(filepath.Dir(path)), "cpu"))
		if err != nil {
			continue
		}
		want := "0"
		if index < count {
			want = "1"
		}
		if cur, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(cur)) == want {
			continue
		}
		os.WriteFile(path, []byte(want), 0o644)
	}
}

// onlineCPUs counts the CPUs in /sys/devices/system/cpu/online ("0-2,5").
func onlineCPUs() int {
	data, err := os.ReadFile(sysfsCPUs + "/online")
	if err != nil {
		return runtime.NumCPU()
	}
	count := 0
	for _, part := range strings.Split(strings.TrimSpace(string(data)), ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			continue
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil {
				continue
			}
		}
		count += b - a + 1
	}
	return count
}

func memTotalKB() int64 {
	f, err := os.Open(procMeminfo)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fields[1], 10, 64)
			return kb
		}
	}
	return 0
}
