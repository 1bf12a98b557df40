"""Peer benchmark: checkpoint / restore / 8-way fork of a gVisor (``runsc``) container.

This gives sandlot's snapshot/restore/fork numbers a reference point from a
well-known user-space-kernel sandbox. Stdlib only; it never installs anything
(``apt-get install -y runsc mmdebstrap`` is the operator's job) and
``available()`` says whether it can run here and, if not, why.

Workload
    One OCI container (rootfs: Debian bookworm ``minbase`` + ``python3``) whose
    only process is ``python3`` holding a 100 MiB ``bytearray`` filled from
    ``os.urandom`` (incompressible, every page dirty). It then blocks reading
    lines from stdin and answers each with ``pong <crc>``, where ``crc`` is the
    CRC-32 of one byte from every 4 KiB page of the buffer, so answering
    touches every page of the 100 MiB.

Method (per run, ``n`` runs)
    1. ``runsc run --detach`` a fresh container and wait for its ``ready <crc>``
       line on stdout (not timed).
    2. ``checkpoint_ms``: wall time of ``runsc checkpoint --image-path IMG ID``
       (the command returns once the image is written and the container has
       stopped; ``--leave-running`` is not used).
    3. ``restore_ms``: wall time from spawning
       ``runsc restore --detach --image-path IMG --bundle B ID2`` until the
       restored process has answered a ping on its stdout with the *same* CRC
       it reported before the checkpoint. The ping is written into the new
       stdin pipe right after spawning, so there is no polling interval; the
       restored process (which was blocked in ``read(0)`` when checkpointed)
       reads it as soon as it runs again. Readiness therefore means "the
       restored process is scheduled, its stdio is rewired, and all 100 MiB
       are readable and intact" - not merely "``runsc restore`` exited".
       gVisor re-attaches the container's stdio to the restoring command's
       stdio, which is what makes this probe possible.
       ``restore_cli_ms`` (when ``runsc restore --detach`` itself exited,
       observed via a pidfd) is reported as well; here it is within a few ms
       of readiness.
    ``fork8_wall_ms``: spawn 8 ``runsc restore --detach`` from one checkpoint
    image at once and measure wall time until all 8 have answered the ping.

    p50 is the median; p90 uses the nearest-rank method, so with ``n <= 10``
    it is the slowest run.

Caveats
    * Platform is ``ptrace``; KVM is deliberately not used (the host kernel
      runs under PVM). Newer gVisor releases have the faster ``systrap``
      platform and lazy memory restore; Debian bookworm's runsc (2022-12)
      has neither, so the measured figures are for that older release.
    * Flags: ``--platform=ptrace --network=none`` with a private ``--root``
      state directory; the spec sets no cgroup resources. Runs as root.
    * Checkpoint images go to ``workdir`` (page cache on the host filesystem;
      nothing is dropped between runs), so restore reads a warm image of
      ~101 MiB (the random payload does not compress).
    * The rootfs is shared read-only by all containers (no overlay), bundles
      are per-run copies of ``config.json`` only.
    * The source container is stopped by ``runsc checkpoint``; teardown
      (``runsc delete --force``, ~1-2 s each here) is not timed.
    * 8-way fork on a 2-core host is CPU-bound: the 8 sandboxes each load the
      image and run the ptrace platform concurrently.
    * Wall-clock numbers are sensitive to other load on the machine.

Hygiene
    Each ``run()`` uses a private scratch dir ``workdir/gvisor-<pid>-*``
    (runsc ``--root`` state, bundle, images, logs); every container it
    creates is ``runsc delete --force``d (and its sandbox killed by pid if
    that fails) and the scratch dir removed, also on errors. Scratch dirs of
    earlier runs whose process is gone (e.g. SIGKILLed) are swept at start.
    Every subprocess call and wait has a timeout. The rootfs is cached at
    ``workdir/rootfs`` (built once with ``mmdebstrap`` from the host's own apt
    sources, under a lock) and reused by later runs.

CLI: ``python3 bench/peer_gvisor.py --runs 3 [--workdir DIR] [--rootfs DIR]``
prints the result of ``run()`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PEER = "gvisor-runsc"
PLATFORM = "ptrace"
DEFAULT_WORKDIR = Path("/var/lib/sandlot/peer")
MEM_BYTES = 100 << 20
FORK_WIDTH = 8

RUNSC_FLAGS = (f"--platform={PLATFORM}", "--network=none")

CMD_TIMEOUT_S = 60.0  # any single runsc command
READY_TIMEOUT_S = 60.0  # container start / restore until it answers
DELETE_TIMEOUT_S = 30.0
ROOTFS_BUILD_TIMEOUT_S = 1800.0
ROOTFS_STAMP = ".sandlot-peer-rootfs-ok"

# Runs inside the container. Blocks in read(0) between pings so a checkpoint
# catches it idle; every answer touches every page of the buffer.
WORKLOAD = f"""\
import os, sys, zlib
b = bytearray(os.urandom({MEM_BYTES}))
def crc():
    return zlib.crc32(b[::4096])
sys.stdout.write(f"ready {{crc()}}\\n")
sys.stdout.flush()
for _ in sys.stdin:
    sys.stdout.write(f"pong {{crc()}}\\n")
    sys.stdout.flush()
"""


class PeerError(RuntimeError):
    """The benchmark could not complete; the message says where."""


# ---------------------------------------------------------------- availability


def available(workdir: Path = DEFAULT_WORKDIR, rootfs: Path | None = None) -> tuple[bool, str]:
    """Whether the benchmark can run here; the string is the reason if not.

    Checks root, a working ``runsc``, and that the rootfs is either cached at
    ``rootfs`` (default ``workdir/rootfs``) or can be built.
    """
    if sys.platform != "linux":
        return False, "gVisor needs Linux"
    if os.geteuid() != 0:
        return False, "needs root (runsc creates namespaces and chroots)"
    if shutil.which("runsc") is None:
        return False, "runsc not installed (Debian package 'runsc')"
    try:
        _runsc_version()
    except (OSError, subprocess.SubprocessError, PeerError) as exc:
        return False, f"runsc does not run: {exc}"
    if not _rootfs_ready(Path(rootfs) if rootfs is not None else Path(workdir) / "rootfs"):
        return _rootfs_buildable()
    return True, "ok"


def _rootfs_buildable() -> tuple[bool, str]:
    if shutil.which("mmdebstrap") is None:
        return False, "rootfs not cached and mmdebstrap not installed"
    if not _host_apt_sources():
        return False, "rootfs not cached and the host has no apt sources"
    return True, "ok"


def _runsc_version() -> str:
    proc = subprocess.run(
        ["runsc", "--version"], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise PeerError(proc.stderr.strip() or f"exit {proc.returncode}")
    first = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "unknown"
    return first.removeprefix("runsc version ").strip()


# ---------------------------------------------------------------------- rootfs


def _host_apt_sources() -> list[str]:
    """The host's own apt source files, passed to mmdebstrap as mirrors."""
    files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file() and legacy.stat().st_size > 0:
        files.append(str(legacy))
    return files


def _rootfs_ready(rootfs: Path) -> bool:
    # Builds happen in a temporary sibling that is renamed into place only on
    # success, so an existing rootfs with python3 is complete.
    return (rootfs / "usr/bin/python3").exists()


@contextlib.contextmanager
def _flock(path: Path, timeout_s: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PeerError(f"timed out waiting for lock {path}") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_rootfs(rootfs: Path) -> Path:
    """Build (once) and return a bookworm minbase+python3 rootfs at ``rootfs``."""
    if _rootfs_ready(rootfs):
        return rootfs
    ok, why = _rootfs_buildable()
    if not ok:
        raise PeerError(why)
    with _flock(rootfs.with_name(rootfs.name + ".lock"), ROOTFS_BUILD_TIMEOUT_S):
        if _rootfs_ready(rootfs):  # built by someone else while we waited
            return rootfs
        if rootfs.exists():
            raise PeerError(f"{rootfs} exists but has no usr/bin/python3; remove it")
        for stale in rootfs.parent.glob(f"{rootfs.name}.tmp-*"):  # killed builds
            shutil.rmtree(stale, ignore_errors=True)
        tmp = rootfs.with_name(f"{rootfs.name}.tmp-{os.getpid()}")
        cmd = [
            "mmdebstrap",
            "--variant=minbase",
            "--mode=root",
            "--quiet",
            "--include=python3",
            "bookworm",
            str(tmp),
            *_host_apt_sources(),
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=ROOTFS_BUILD_TIMEOUT_S
            )
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                raise PeerError(f"mmdebstrap failed ({proc.returncode}): {tail}")
            (tmp / ROOTFS_STAMP).write_text(f"{' '.join(cmd)}\n")
            tmp.rename(rootfs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return rootfs


# ------------------------------------------------------------------ containers


class _LineReader:
    """Reads lines from a pipe fd with deadlines (never blocks forever)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False

    def poll(self) -> str | None:
        """Consume available bytes; return one complete line if there is one."""
        if b"\n" not in self.buf and not self.eof:
            ready, _, _ = select.select([self.fd], [], [], 0)
            if ready:
                chunk = os.read(self.fd, 65536)
                self.buf += chunk
                self.eof = not chunk
        if b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            return line.decode(errors="replace")
        return None

    def expect(self, prefix: str, deadline: float) -> str:
        """Return the first line starting with ``prefix`` (other lines are skipped)."""
        while True:
            line = self.poll()
            if line is not None:
                if line.startswith(prefix):
                    return line
                continue
            if self.eof:
                raise PeerError(f"container stdout closed before {prefix!r}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"timed out waiting for {prefix!r}")
            select.select([self.fd], [], [], min(left, 1.0))


@dataclass
class _Container:
    cid: str
    stdin_w: int
    reader: _LineReader
    cli: subprocess.Popen[bytes]
    started: float

    def ping(self) -> None:
        os.write(self.stdin_w, b"ping\n")

    def close_pipes(self) -> None:
        for fd in (self.stdin_w, self.reader.fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Timing:
    ready_ms: float | None = None
    cli_ms: float | None = None


@dataclass
class _Session:
    """One benchmark session: private runsc state root, scratch dir, cleanup."""

    scratch: Path
    rootfs: Path
    live: dict[str, _Container] = field(default_factory=dict)
    created: set[str] = field(default_factory=set)
    seq: int = 0

    @property
    def state_root(self) -> Path:
        return self.scratch / "state"

    def runsc(self, *args: str) -> list[str]:
        return [
            "runsc",
            f"--root={self.state_root}",
            f"--log={self.scratch / 'runsc.log'}",
            *RUNSC_FLAGS,
            *args,
        ]

    def new_id(self, kind: str) -> str:
        self.seq += 1
        return f"sandlot-peer-{os.getpid()}-{kind}{self.seq}"

    def make_bundle(self) -> Path:
        bundle = self.scratch / "bundle"
        bundle.mkdir(exist_ok=True)
        config = bundle / "config.json"
        if config.exists():
            return bundle
        proc = subprocess.run(
            ["runsc", "spec", "--bundle", str(bundle), "--", "/usr/bin/python3", "-c", WORKLOAD],
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise PeerError(f"runsc spec failed: {proc.stderr.strip()}")
        spec = json.loads(config.read_text())
        spec["root"] = {"path": str(self.rootfs), "readonly": True}
        spec["process"]["terminal"] = False
        spec["hostname"] = "peer"
        config.write_text(json.dumps(spec, indent=2))
        return bundle

    def spawn(self, cid: str, args: Sequence[str]) -> _Container:
        """Start ``runsc <args>`` whose container stdio are fresh pipes."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err = open(self.scratch / f"{cid}.stderr", "wb")
        self.created.add(cid)
        try:
            started = time.monotonic()
            cli = subprocess.Popen(
                self.runsc(*args), stdin=in_r, stdout=out_w, stderr=err, start_new_session=True
            )
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        finally:
            err.close()
        os.close(in_r)
        os.close(out_w)
        ctr = _Container(cid, in_w, _LineReader(out_r), cli, started)
        self.live[cid] = ctr
        return ctr

    def check_cli(self, ctr: _Container) -> None:
        """Wait for the (detaching) runsc command and require success."""
        try:
            rc = ctr.cli.wait(timeout=CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PeerError(f"runsc did not return for {ctr.cid}") from None
        if rc != 0:
            msg = (self.scratch / f"{ctr.cid}.stderr").read_text(errors="replace").strip()
            raise PeerError(f"runsc failed for {ctr.cid} ({rc}): {msg[-400:]}")

    def checkpoint(self, ctr: _Container, image: Path) -> float:
        image.mkdir(parents=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            self.runsc("checkpoint", f"--image-path={image}", ctr.cid),
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
        )
        elapsed = (time.monotonic() - t0) * 1000
        if proc.returncode != 0:
            raise PeerError(f"runsc checkpoint failed: {proc.stderr.strip()[-400:]}")
        return elapsed

    def delete(self, cid: str) -> None:
        """Force-delete a container; kill its sandbox by pid if runsc cannot."""
        ctr = self.live.pop(cid, None)
        pid = self._sandbox_pid(cid)
        try:
            subprocess.run(
                self.runsc("delete", "--force", cid),
                capture_output=True,
                timeout=DELETE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            pass
        if pid and self._sandbox_pid(cid) == pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if ctr is not None:
            ctr.close_pipes()
            if ctr.cli.poll() is None:
                ctr.cli.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    ctr.cli.wait(timeout=5)
        self.created.discard(cid)

    def _sandbox_pid(self, cid: str) -> int | None:
        try:
            proc = subprocess.run(
                self.runsc("state", cid), capture_output=True, text=True, timeout=10
            )
            pid = int(json.loads(proc.stdout)["pid"]) if proc.returncode == 0 else 0
        except (subprocess.SubprocessError, ValueError, KeyError, TypeError):
            return None
        return pid if pid > 0 else None

    def delete_all(self, cids: Sequence[str]) -> None:
        """Delete several containers concurrently (``runsc delete`` takes ~1-2 s each)."""
        with ThreadPoolExecutor(max_workers=FORK_WIDTH) as pool:
            for fut in [pool.submit(self.delete, cid) for cid in cids]:
                fut.result()

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.delete_all(sorted(self.created | set(self.live)))
        for cid in sorted(self.created | set(self.live)):  # anything the batch missed
            with contextlib.suppress(Exception):
                self.delete(cid)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _await_ready(ctrs: Sequence[_Container], crc: str, timeout_s: float) -> list[_Timing]:
    """Wait until every container answered ``pong <crc>``; time that and CLI exit.

    Both times are in ms since the container's runsc command was spawned. The
    CLI exit is observed through a pidfd so it is exact even though it is
    waited for concurrently with the answer.
    """
    deadline = time.monotonic() + timeout_s
    timings = {c.cid: _Timing() for c in ctrs}
    pidfds: dict[int, _Container] = {}
    try:
        for c in ctrs:
            pidfds[os.pidfd_open(c.cli.pid)] = c
        while True:
            now = time.monotonic()
            for fd, c in list(pidfds.items()):
                if c.cli.poll() is not None:
                    timings[c.cid].cli_ms = (now - c.started) * 1000
                    os.close(fd)
                    del pidfds[fd]
            for c in ctrs:
                t = timings[c.cid]
                while t.ready_ms is None and (line := c.reader.poll()) is not None:
                    if not line.startswith("pong "):
                        continue
                    if line.split()[1:] != [crc]:
                        raise PeerError(f"{c.cid}: memory changed across restore ({line!r})")
                    t.ready_ms = (now - c.started) * 1000
                if t.ready_ms is None and c.reader.eof:
                    raise PeerError(f"{c.cid}: stdout closed before answering")
            waiting = [c.reader.fd for c in ctrs if timings[c.cid].ready_ms is None]
            if not waiting and not pidfds:
                return [timings[c.cid] for c in ctrs]
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"timed out: {len(waiting)} of {len(ctrs)} never answered")
            select.select([*waiting, *pidfds], [], [], min(left, 1.0))
    finally:
        for fd in pidfds:
            os.close(fd)


# --------------------------------------------------------------------- measure


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _measure(s: _Session, n: int) -> dict[str, object]:
    bundle = s.make_bundle()
    checkpoint_ms: list[float] = []
    restore_ms: list[float] = []
    restore_cli_ms: list[float] = []
    start_ms: list[float] = []
    image_bytes = 0
    image = s.scratch / "image"
    crc = ""

    for i in range(n):
        src_id = s.new_id("src")
        src = s.spawn(src_id, ["run", "--detach", f"--bundle={bundle}", src_id])
        s.check_cli(src)
        crc = src.reader.expect("ready ", time.monotonic() + READY_TIMEOUT_S).split()[1]
        start_ms.append((time.monotonic() - src.started) * 1000)

        shutil.rmtree(image, ignore_errors=True)
        checkpoint_ms.append(s.checkpoint(src, image))
        image_bytes = sum(f.stat().st_size for f in image.iterdir())
        s.delete(src_id)

        dst_id = s.new_id("dst")
        dst = s.spawn(
            dst_id, ["restore", "--detach", f"--image-path={image}", f"--bundle={bundle}", dst_id]
        )
        dst.ping()
        (timing,) = _await_ready([dst], crc, READY_TIMEOUT_S)
        s.check_cli(dst)
        restore_ms.append(timing.ready_ms or 0.0)
        restore_cli_ms.append(timing.cli_ms or 0.0)
        s.delete(dst_id)
        if i < n - 1:
            shutil.rmtree(image, ignore_errors=True)

    # 8-way fork: restore FORK_WIDTH containers from the last image at once.
    t0 = time.monotonic()
    forks = []
    for _ in range(FORK_WIDTH):
        cid = s.new_id("fork")
        ctr = s.spawn(
            cid, ["restore", "--detach", f"--image-path={image}", f"--bundle={bundle}", cid]
        )
        ctr.ping()
        forks.append(ctr)
    fork_timings = _await_ready(forks, crc, READY_TIMEOUT_S * 2)
    fork8_wall_ms = max(
        (c.started - t0) * 1000 + (t.ready_ms or 0.0)
        for c, t in zip(forks, fork_timings, strict=True)
    )
    for ctr in forks:
        s.check_cli(ctr)
    s.delete_all([c.cid for c in forks])

    return {
        "checkpoint_ms_p50": round(statistics.median(checkpoint_ms), 1),
        "restore_ms_p50": round(statistics.median(restore_ms), 1),
        "restore_ms_p90": round(_pct(restore_ms, 0.9), 1),
        "fork8_wall_ms": round(fork8_wall_ms, 1),
        "restore_cli_ms_p50": round(statistics.median(restore_cli_ms), 1),
        "start_ms_p50": round(statistics.median(start_ms), 1),
        "fork8_each_ready_ms": sorted(round(t.ready_ms or 0.0, 1) for t in fork_timings),
        "image_bytes": image_bytes,
        "samples": {
            "checkpoint_ms": [round(v, 1) for v in checkpoint_ms],
            "restore_ms": [round(v, 1) for v in restore_ms],
        },
    }


def _sweep_stale(workdir: Path) -> None:
    """Remove containers and scratch left by a run of this module that was killed."""
    for scratch in workdir.glob("gvisor-*-*"):
        try:
            pid = int(scratch.name.split("-")[1])
        except ValueError:
            continue
        if pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue  # ours, or a concurrent run that is still alive
        session = _Session(scratch=scratch, rootfs=Path("/nonexistent"))
        with contextlib.suppress(Exception):
            proc = subprocess.run(
                session.runsc("list", "--quiet"), capture_output=True, text=True, timeout=10
            )
            session.created.update(proc.stdout.split())
        session.cleanup()


def run(
    n: int = 3, workdir: Path = DEFAULT_WORKDIR, rootfs: Path | None = None
) -> dict[str, object]:
    """Run the benchmark ``n`` times; never raises for environment problems.

    ``workdir`` holds the cached rootfs (``workdir/rootfs`` unless ``rootfs``
    is given) and a per-call scratch directory (bundle, runsc state,
    checkpoint images) that is removed before returning.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    workdir = Path(workdir)
    rootfs = Path(rootfs) if rootfs is not None else workdir / "rootfs"
    ok, why = available(workdir, rootfs)
    if not ok:
        return {"peer": PEER, "unavailable": why}
    try:
        ensure_rootfs(rootfs)
    except (PeerError, OSError, subprocess.SubprocessError) as exc:
        return {"peer": PEER, "unavailable": f"rootfs: {exc}"}
    version = _runsc_version()

    workdir.mkdir(parents=True, exist_ok=True)
    _sweep_stale(workdir)
    scratch = Path(tempfile.mkdtemp(prefix=f"gvisor-{os.getpid()}-", dir=workdir))
    session = _Session(scratch=scratch, rootfs=rootfs)
    session.state_root.mkdir()
    try:
        figures = _measure(session, n)
    except (PeerError, OSError, subprocess.SubprocessError) as exc:
        return {"peer": PEER, "version": version, "unavailable": f"run failed: {exc}"}
    finally:
        session.cleanup()
    return {
        "peer": PEER,
        "version": version,
        "platform": PLATFORM,
        **figures,
        "runs": n,
        "notes": (
            f"runsc {' '.join(RUNSC_FLAGS)}; python3 holding {MEM_BYTES >> 20} MiB urandom "
            "bytearray; restore = spawn of 'runsc restore --detach' until the restored "
            "process answers a stdin ping with an unchanged CRC over one byte per 4 KiB "
            f"page; fork{FORK_WIDTH} = {FORK_WIDTH} concurrent restores of one image until "
            "all answered; warm page cache; p90 is nearest-rank"
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--rootfs", type=Path, default=None)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    result = run(args.runs, args.workdir, args.rootfs)
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0 if "unavailable" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
