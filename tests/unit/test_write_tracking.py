"""Write tracking (vmm/write_tracking.py) and the precopy built on it (vmm/ram_copy.py), on a
real process that loads the preload library as QEMU does: a Python process named
qemu-system-*, with a private mapping of a file (a restored VM's RAM) and an anonymous one (a
cold-booted VM's). The kernel does the tracking; nothing is faked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sandlot.errors import VmmError
from sandlot.vmm import memory, ram_copy, write_tracking
from sandlot.vmm.machine import MachineSpec
from sandlot.vmm.memory import PAGE, Region
from sandlot.vmm.ram_copy import TrackedCopy

PAGES = 4096  # 16 MiB per region

CHILD = r"""
import ctypes, mmap, sys, threading
PAGE = 4096
path, pages = sys.argv[1], int(sys.argv[2])
f = open(path, "r+b")
maps = {"file": mmap.mmap(f.fileno(), pages * PAGE, flags=mmap.MAP_PRIVATE),
        "anon": mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)}
print(*(ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps.values()), flush=True)
busy = threading.Event()

def hammer():
    # Every third page gets the round number; and each round one page never written before
    # (a new copy-on-write page in the file mapping, a new page in the anonymous one).
    rnd = frontier = 0
    while True:
        busy.wait()
        rnd = rnd % 255 + 1
        frontier = (frontier + 3) % pages
        for m in maps.values():
            for i in range(0, len(m), PAGE * 3):
                m[i] = rnd
            m[(frontier + 1) % pages * PAGE + 7] = rnd

threading.Thread(target=hammer, daemon=True).start()
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "write":
        maps[args[0]][int(args[1]) * PAGE] = int(args[2])
    elif cmd == "read":
        maps[args[0]][int(args[1]) * PAGE]
    elif cmd == "busy":
        busy.set()
    print("ok", flush=True)
"""


class Child:
    def __init__(self, tmp_path) -> None:
        base = tmp_path / "ram"
        with open(base, "wb") as f:
            f.write(os.urandom(PAGES * PAGE // 2))  # data, then a hole
            f.truncate(PAGES * PAGE)
        env = {**os.environ, **write_tracking.qemu_env()}
        self.proc = subprocess.Popen(
            ["qemu-system-test", "-c", CHILD, str(base), str(PAGES)], executable=sys.executable,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        file_at, anon_at = (int(x) for x in self.proc.stdout.readline().split())
        self.regions = {"file": Region("ram", file_at, PAGES * PAGE, base),
                        "anon": Region("dimm", anon_at, PAGES * PAGE, None)}
        self.tracker = write_tracking.open_tracker(self.proc.pid)
        assert self.tracker is not None, "the preloaded library opened no userfaultfd"

    def send(self, *words) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n"

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(self.proc.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.001)

    def close(self) -> None:
        self.tracker.close()
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def child(tmp_path):
    if not write_tracking.kernel_supports():
        pytest.skip("this kernel has no asynchronous write-protection (Linux 6.7+)")
    if not write_tracking.qemu_env():
        pytest.skip("the preload library cannot be built here (no C compiler)")
    made = Child(tmp_path)
    yield made
    made.close()


def test_collect_lists_exactly_the_pages_written_since_the_last(child):
    file, anon = child.regions["file"], child.regions["anon"]
    child.send("write", "file", 5, 1)
    assert 5 in child.tracker.collect(file)  # the first arms: all it lists may be unwritten
    child.tracker.collect(anon)
    for name in ("file", "anon"):
        child.send("write", name, 10, 1)
        child.send("write", name, 3000, 1)  # in the file's hole
    assert child.tracker.collect(file).tolist() == [10, 3000]
    assert child.tracker.collect(anon).tolist() == [10, 3000]
    assert child.tracker.collect(file).tolist() == []
    child.send("write", "file", 10, 2)  # again: an anonymous page written again
    child.send("write", "file", 11, 2)  # a file page copied on write
    child.send("read", "file", 12)  # only read: not written
    child.send("write", "anon", 4095, 2)
    child.send("read", "anon", 500)
    assert child.tracker.collect(file).tolist() == [10, 11]
    assert child.tracker.collect(anon).tolist() == [4095]
    assert child.tracker.collect(file).tolist() == []
    assert child.tracker.collect(anon).tolist() == []


def test_a_precopy_of_a_busy_process_is_its_memory_at_the_stop(child):
    """The process rewrites pages and makes new ones while it is copied; what the copy holds
    after the stop is exactly its changed pages, each as it was at the stop. Four captures in
    a row, as a sandbox snapshotted again and again."""
    child.send("busy")
    time.sleep(0.2)
    regions = [child.regions["file"], child.regions["anon"]]
    for _ in range(4):
        copier = TrackedCopy(child.proc.pid, regions, child.tracker)
        try:
            copier.prepare()  # while it writes
            time.sleep(0.05)
            child.stop()
            copier.in_pause()
            truth = {}
            for region in regions:
                pages = memory.changed_pages(child.proc.pid, region)
                truth[region.name] = (pages, _read(child.proc.pid, region, pages))
            os.kill(child.proc.pid, signal.SIGCONT)
            deltas = copier.finish()
            assert copier.pages_in_pause < sum(len(p) for p, _ in truth.values())
            for delta in deltas:
                pages, data = truth[delta.region.name]
                assert delta.pages.tolist() == pages.tolist()
                assert _held(delta) == data
        finally:
            copier.close()


def _holds_all_copied_in_the_pause(child: Child, copier: TrackedCopy) -> None:
    """The copy is the stopped process's changed pages, every one copied in the pause."""
    for delta in copier.finish():
        pages = memory.changed_pages(child.proc.pid, delta.region)
        assert delta.pages.tolist() == pages.tolist()
        assert _held(delta) == _read(child.proc.pid, delta.region, pages)
    assert copier.pages_in_pause == sum(len(d.pages) for d in copier.deltas)


def _held(delta) -> bytes:
    """The delta's pages, in page order."""
    return b"".join(bytes(delta.data[slot * PAGE:(slot + 1) * PAGE])
                    for slot in delta.slot_of().tolist())


def _read(pid: int, region: Region, pages: np.ndarray) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        out = bytearray()
        for page in pages.tolist():
            mem.seek(region.start + page * PAGE)
            out += mem.read(PAGE)
    return bytes(out)


def test_a_precopy_whose_tracking_fails_copies_it_all_in_the_pause(child):
    child.send("busy")
    time.sleep(0.1)
    regions = [child.regions["file"], child.regions["anon"]]
    copier = TrackedCopy(child.proc.pid, regions, child.tracker)
    try:
        copier.prepare()
        child.tracker.close()  # its descriptors gone: the scan in the pause fails
        child.stop()
        copier.in_pause()
        assert copier.tracking_failed
        _holds_all_copied_in_the_pause(child, copier)
    finally:
        copier.close()


def test_a_precopy_without_room_for_new_pages_copies_it_all_in_the_pause(child, monkeypatch):
    """Where the address space for every page cannot be reserved (strict overcommit), the
    buffer has a margin only; more pages new in the pause than it holds: the pause copies
    every changed page, and what the tracker saw stays whole for the next capture."""

    class NoReserve(ram_copy.PageBuffer):
        def __init__(self, pages: int, populate: int | None = None) -> None:
            if populate is not None:
                raise OSError(12, "Cannot allocate memory")
            super().__init__(pages)

    monkeypatch.setattr(ram_copy, "PageBuffer", NoReserve)
    monkeypatch.setattr(ram_copy, "WRITTEN_MARGIN_PAGES", 0)
    child.send("busy")
    time.sleep(0.1)
    regions = [child.regions["file"], child.regions["anon"]]
    copier = TrackedCopy(child.proc.pid, regions, child.tracker)
    try:
        copier.prepare()
        time.sleep(0.05)  # the hammer makes new pages meanwhile
        child.stop()
        copier.in_pause()
        assert not copier.tracking_failed and copier.written() is not None
        _holds_all_copied_in_the_pause(child, copier)
    finally:
        copier.close()


def test_a_closed_tracker_refuses_and_waits_for_a_scan_under_way(child):
    """A capture cancelled mid-scan leaves the scan's thread running: closing the tracker waits
    for it, and a scan after the close is an error, never a read of a reused descriptor."""
    anon = child.regions["anon"]
    child.tracker.collect(anon)
    scans = [threading.Thread(target=child.tracker.collect, args=(anon,)) for _ in range(4)]
    for scan in scans:
        scan.start()
    child.tracker.close()
    for scan in scans:
        scan.join()
    with pytest.raises(VmmError, match="closed"):
        child.tracker.collect(anon)
    child.tracker.close()  # twice: nothing to do


def test_guest_ram_is_never_merged_by_the_host():
    """KSM would merge identical pages across tenants (a side channel), and a page it turns
    into the zero page loses its write-tracking mark: every RAM backend says merge=off, which
    leaves the device model (what snapshots are checked against) as it was."""
    spec = MachineSpec(run_dir=Path("/r"), kernel=Path("/k"), initrd=Path("/i"),
                       disk=Path("/d"), ram_path=Path("/m"), machine_type="pc-q35-7.2",
                       dimm_mb=512, dimm_path=Path("/m2"))
    backends = [a for a in spec.command() if a.startswith("memory-backend")]
    assert len(backends) == 2 and all(b.endswith(",merge=off") for b in backends)
    assert not any("merge" in a for a in spec.command(host_options=False))


ADVISE = """
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
area = mmap.mmap(-1, 4 << 20)
at = ctypes.addressof(ctypes.c_char.from_buffer(area))
assert libc.madvise(at, 4 << 20, 14) == 0  # MADV_HUGEPAGE, as QEMU advises guest RAM
inside = False
for line in open("/proc/self/smaps"):
    first = line.split()[0]
    if "-" in first and ":" not in first:  # a mapping's header: start-end perms ...
        lo, hi = (int(x, 16) for x in first.split("-"))
        inside = lo <= at < hi
    elif line.startswith("VmFlags") and inside:
        print("hg" in line.split())
"""


@pytest.mark.parametrize("on_demand", [False, True])
def test_ram_read_on_demand_is_not_advised_huge_pages(on_demand):
    """A lazily restored VM's RAM (a file served on demand): QEMU's MADV_HUGEPAGE would make
    every page fault read 4 MiB of it; the preload library skips that advice, and only then."""
    env = write_tracking.qemu_env(ram_no_hugepage=on_demand)
    if on_demand and not env:
        pytest.skip("the preload library cannot be built here (no C compiler)")
    out = subprocess.run(["qemu-system-test", "-c", ADVISE], executable=sys.executable,
                         env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(not on_demand)]
