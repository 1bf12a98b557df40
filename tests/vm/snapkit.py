"""Helpers for the snapshot, restore and fork VM tests.

`start_holder` runs a guest process that keeps a random token only in its memory and tells it
on demand (SIGUSR1 makes it write pid, token, the restore generation it reads and a digest of its
ballast to a file that the asking command deletes again), so a test that sees the same answer
after a restore proves the process and its memory survived, not just a file.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sandlot import Sandbox

HOLDER_PY = r"""
import hashlib, os, signal, sys
token = os.urandom(16).hex()
ballast = bytearray(os.urandom(int(sys.argv[1]) << 20)) if len(sys.argv) > 1 else bytearray()

def answer(*_):
    with open("/run/sandlot/generation") as f:
        gen = f.read().strip()
    digest = hashlib.sha256(ballast[::4096]).hexdigest()[:16]
    with open("/tmp/holder.answer.tmp", "w") as f:
        f.write(f"{os.getpid()} {token} {gen} {digest}\n")
    os.replace("/tmp/holder.answer.tmp", "/tmp/holder.answer")

signal.signal(signal.SIGUSR1, answer)
with open("/tmp/holder.pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace("/tmp/holder.pid.tmp", "/tmp/holder.pid")
while True:
    signal.pause()
"""

ASK = ("rm -f /tmp/holder.answer; kill -USR1 $(cat /tmp/holder.pid) || exit 2; "
       "for i in $(seq 400); do if [ -e /tmp/holder.answer ]; then cat /tmp/holder.answer; "
       "rm -f /tmp/holder.answer; exit 0; fi; sleep 0.05; done; exit 1")


@dataclass(frozen=True)
class Answer:
    """What the holder process says: its pid, its in-memory token, the generation it reads
    from /run/sandlot/generation, and a digest of its ballast memory."""

    pid: int
    token: str
    generation: str
    digest: str

    @property
    def memory(self) -> tuple[int, str, str]:
        """The parts that must survive a snapshot (the generation changes on restore)."""
        return self.pid, self.token, self.digest


def start_holder(sbx: Sandbox, ballast_mb: int = 0) -> Answer:
    """Start the token-holding process in `sbx` and return its first answer."""
    sbx.files.write("/root/holder.py", HOLDER_PY)
    sbx.commands.start(f"exec python3 /root/holder.py {ballast_mb} >/tmp/holder.log 2>&1")
    sbx.commands.run("for i in $(seq 1200); do [ -s /tmp/holder.pid ] && exit 0; sleep 0.05; "
                     "done; exit 1", timeout=90, check=True)
    return ask(sbx)


def ask(sbx: Sandbox) -> Answer:
    """Ask the holder for its token (raises CommandExitError if it is not running)."""
    out = sbx.commands.run(ASK, timeout=60, check=True).stdout.split()
    pid, token, generation, digest = out
    return Answer(int(pid), token, generation, digest)


def holder_gone(sbx: Sandbox) -> bool:
    return sbx.commands.run("kill -0 $(cat /tmp/holder.pid)").exit_code != 0


CLOCK_PROBE = ("exec python3 -u -c 'import sys, time\n"
               "for _ in sys.stdin: print(repr(time.time()), flush=True)'")


def clock_error(sbx: Sandbox, samples: int = 5) -> tuple[float, float]:
    """(guest clock - host clock, allowed error) for the tightest of `samples` probes.

    A process in the guest prints its clock for every line it reads on stdin; the host notes
    its own clock before sending the line (t0) and when the answer streams back (t1). The guest
    read its clock in between, so a guest clock within 50 ms of the host's lies within
    [t0 - 0.05, t1 + 0.05]: |guest - (t0 + t1) / 2| <= 0.05 + (t1 - t0) / 2. The round trip is
    a few ms, unlike a new command's (bash and HTTP setup: 100-300 ms on TCG).
    """
    handle = sbx.commands.start(CLOCK_PROBE)
    answers: queue.Queue[tuple[float, float]] = queue.Queue()
    pending = [""]

    def on_stdout(data: str) -> None:
        now = time.time()
        *lines, pending[0] = (pending[0] + data).split("\n")
        for line in lines:
            answers.put((now, float(line)))

    follower = threading.Thread(target=handle.wait, kwargs={"on_stdout": on_stdout},
                                daemon=True)
    follower.start()
    best: tuple[float, float] | None = None
    try:
        for i in range(samples + 1):  # the first answer waits for python to start
            t0 = time.time()
            handle.send_stdin("\n")
            t1, guest = answers.get(timeout=60)
            error, half = guest - (t0 + t1) / 2, (t1 - t0) / 2
            if i and (best is None or half < best[1]):
                best = (error, half)
    finally:
        handle.kill()
        follower.join(30)
    assert best is not None
    return best[0], 0.05 + best[1]


def urandom(sbx: Sandbox) -> str:
    return sbx.commands.run("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").stdout


def generation(sbx: Sandbox) -> tuple[str, str]:
    """(/run/sandlot/generation, $SANDLOT_GENERATION) as a new command sees them."""
    out = sbx.commands.run("cat /run/sandlot/generation; echo $SANDLOT_GENERATION").stdout
    file_gen, env_gen = out.split()
    return file_gen, env_gen


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def hot_dir(shm_root: Path, snapshot_id: str) -> Path:
    return shm_root / "hot" / snapshot_id


class Reaper:
    """Collects sandboxes a test made and kills them at teardown (`reap(sbx)` returns `sbx`)."""

    def __init__(self) -> None:
        self.boxes: list[Sandbox] = []

    def __call__(self, *boxes: Sandbox) -> Sandbox:
        self.boxes.extend(boxes)
        return boxes[0]

    def kill_all(self) -> None:
        for sbx in self.boxes:
            try:
                sbx.kill()
            except Exception:  # noqa: BLE001 - cleanup best effort
                pass


HAMMER = r"""
import signal, time
buf = bytearray(64 << 20)
rnd = 0
def report(*_):
    found = sorted({buf[i] for i in range(0, len(buf), 4096)})
    with open("/tmp/hammer.out", "w") as f:
        f.write(" ".join(map(str, found)) + "\n")
signal.signal(signal.SIGUSR1, report)
open("/tmp/hammer.pid", "w").write("started\n")
while True:
    rnd = rnd % 255 + 1
    for i in range(0, len(buf), 4096):
        buf[i] = rnd
"""
# The kernel busy too, inside getrandom() for seconds under TCG: page allocation, RNG, copies.
STIR = ("python3 -c 'import os, time; b = bytearray(os.urandom(50 << 20)); time.sleep(600)' "
        ">/dev/null 2>&1 & sleep 0.2")


def start_hammer(sbx: Sandbox) -> None:
    """A guest process rewriting one byte of every page of 64 MiB with a round number, over
    and over (`consistent` checks a snapshot of it)."""
    sbx.files.write("/root/hammer.py", HAMMER)
    sbx.commands.run("python3 /root/hammer.py >/dev/null 2>&1 &", check=True)
    wait_for(lambda: sbx.files.exists("/tmp/hammer.pid"), timeout=30, what="the hammer")


def consistent(sbx: Sandbox) -> bool:
    """The hammer's memory holds one round, or two adjacent ones."""
    sbx.commands.run("rm -f /tmp/hammer.out; pkill -USR1 -f hammer.py", check=True)
    out = wait_for(lambda: sbx.commands.run("cat /tmp/hammer.out 2>/dev/null").stdout,
                   timeout=30, what="the hammer's report")
    values = [int(v) for v in out.split()]
    if len(values) == 1:
        return True
    low, high = values[0], values[-1]
    return len(values) == 2 and (high - low == 1 or (low, high) == (1, 255))
