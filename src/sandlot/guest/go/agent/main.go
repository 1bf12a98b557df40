// Command sandlot-agent is sandlot's guest agent: it runs inside the VM (a static binary that
// needs nothing from the image) and serves the host over virtio-serial.
//
// See docs/guest-protocol.md. One host session at a time; a new `hello` starts a new session
// (the old one's subscriptions and open uploads are dropped; processes keep running and keep
// buffering their output, so a new session can `attach` to them).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"sandlot/guest/wire"
)

const (
	protoVersion = 1
	portName     = "org.sandlot.agent"
	runDir       = "/run/sandlot"
	defaultPath  = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// A `read` with `window` sends at most that many data chunks ahead of the host's `credit`
	// frames, so a slow consumer of one file holds back that file only, not the whole link;
	// an `exec` or `attach` with `window` does the same for a process's output (its pipe
	// fills and the process waits, as it would writing to a slow terminal).
	creditTimeout = 120 * time.Second // without credit: the host is gone; stop sending
	// Why: output of a process nobody listens to (background, or host away) is kept for a
	// later attach, but never more than this per process; the oldest chunks are dropped first.
	maxBufferedOutput = 8 << 20
	maxFinished       = 256
	terminalDrain     = 2 * time.Second // a terminal's last output may take this long to arrive
	// Why: a `list` answer is one frame header (at most MaxHeader): stop walking well before.
	maxListEntries = 100000
	listReplyBytes = wire.MaxHeader - (64 << 10)
)

// caps is what the hello announces (docs/guest-protocol.md, "Capabilities").
var caps = []string{"exec", "attach", "stdin", "files", "restore", "cpus", "step_clock",
	"read_credit", "list_limit", "output_credit", "pty", "file_metadata", "grow_disk", "volumes", "write_credit"}

func main() {
	fd := flag.Int("fd", -1, "serve this connected descriptor instead of the virtio port, and "+
		"exit at its EOF (tests run the agent on the host this way)")
	describe := flag.Bool("describe", false, "print the ops and capabilities as JSON and exit")
	without := flag.String("without-cap", "", "do not announce this capability (tests)")
	flag.Parse()
	if *without != "" {
		kept := caps[:0:0]
		for _, c := range caps {
			if c != *without {
				kept = append(kept, c)
			}
		}
		caps = kept
	}
	// Why: a guest boots with one CPU online, so GOMAXPROCS would be 1, and then a goroutine
	// blocked in a system call (a command's wait4, a fork's exec) holds the only P until
	// sysmon takes it back: output and exits of other requests waited for that. A second P
	// runs them at once (the guest kernel shares its CPU between the two threads).
	if runtime.GOMAXPROCS(0) < 2 {
		runtime.GOMAXPROCS(2)
	}
	agent := newAgent(nil)
	if *describe {
		ops := make([]string, 0, len(agent.handlers))
		for name := range agent.handlers {
			ops = append(ops, name)
		}
		out, _ := json.Marshal(map[string]any{"ops": ops, "caps": caps, "proto": protoVersion})
		fmt.Println(string(out))
		return
	}
	var ch *channel
	if *fd >= 0 {
		if err := syscall.SetNonblock(*fd, true); err != nil {
			fmt.Fprintln(os.Stderr, "sandlot-agent:", err)
			os.Exit(1)
		}
		ch = newChannel(*fd, true)
	} else {
		ch = openPort()
	}
	agent.ch = ch
	var dec wire.Decoder
	for {
		data := ch.recv()
		if len(data) == 0 {
			if ch.exitOnEOF {
				os.Exit(0)
			}
			// No host connected: the port reads EOF until one connects. Drop partial input.
			dec.Reset()
			time.Sleep(5 * time.Millisecond)
			continue
		}
		for _, f := range dec.Feed(data) {
			agent.handle(f.Header, f.Payload)
		}
	}
}

// openPort finds and opens the agent's virtio-serial port, waiting for it to appear.
func openPort() *channel {
	for {
		names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
		for _, nameFile := range names {
			name, err := os.ReadFile(nameFile)
			if err != nil || strings.TrimSpace(string(name)) != portName {
				continue
			}
			dev := "/dev/" + filepath.Base(filepath.Dir(nameFile))
			fd, err := syscall.Open(dev, syscall.O_RDWR|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
			if err == nil {
				return newChannel(fd, false)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
}
