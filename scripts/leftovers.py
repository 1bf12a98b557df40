#!/usr/bin/env python3
"""What a test run left on this host: `make ci` snapshots the host before `.ci/run` and checks
it after (standard library only: it runs before and after any virtualenv).

    leftovers.py snapshot FILE            host state now, to FILE
    leftovers.py check FILE TAG WORKDIR   what the run added and left; exit 1 if anything

Processes are the run's when their environment carries `SANDLOT_CI_RUN=TAG` (what `make ci`
exports: everything the run started inherits it) or their command line names WORKDIR: sandlot
servers, QEMUs, SeaweedFS, PostgreSQL, docker-registry, and anything else. They are listed,
then killed. Host objects with no owner to ask (network namespaces, sandbox veths, nft tables
and per-sandbox nft objects, sandlot run/tmpfs dirs, VM cgroups, VM uids, `sandlot-pg-*`
dirs) count when new since the snapshot and still there after a settling time (another
program's come and go); they are listed only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

KEPT_DIRS = {"/run/sandlot-uids", "/run/sandlot-mounts"}  # the jails' registries, shared
SETTLE_S = 20  # a host object must outlive this to count (the kernel removes veths lazily)


def _run(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _glob(pattern: str, root: str, dirs: bool = False) -> list[str]:
    return sorted(str(p) for p in Path(root).glob(pattern) if not dirs or p.is_dir())


def objects() -> dict[str, list[str]]:
    """Host-wide objects a sandlot test run makes, by kind."""
    out: dict[str, list[str]] = {
        "netns": sorted(_run("ip", "netns", "list").split("\n")),
        "links": sorted(n for n in os.listdir("/sys/class/net") if n.startswith(("slv", "slt"))),
        # `inet sandlot` is the deployments' table, there to stay (a test run's, `inet
        # sandlot_<tag>`, goes with the run): the per-sandbox objects of each are checked below
        "nft tables": sorted(set(_run("nft", "list", "tables").splitlines())
                             - {"table inet sandlot"}),
        "dirs": [d for d in _glob("sandlot-*", "/run") + _glob("sandlot-*", "/dev/shm")
                 + _glob("sandlot-pg-*", "/tmp") if d not in KEPT_DIRS],
        "cgroups": _glob("sandlot/*", "/sys/fs/cgroup", dirs=True)  # v2; v1 below
        + _glob("*/sandlot/*", "/sys/fs/cgroup", dirs=True),
        "vm uids": _glob("*", "/run/sandlot-uids") if Path("/run/sandlot-uids").is_dir() else [],
    }
    out["netns"] = [n.split()[0] for n in out["netns"] if n.strip()]
    tables = re.findall(r"^table inet (sandlot(?:_[a-z0-9]+)?)$", _run("nft", "list", "tables"),
                        re.MULTILINE)
    nft = []
    for table in tables:
        raw = _run("nft", "-j", "list", "table", "inet", table) or '{"nftables": []}'
        for item in json.loads(raw).get("nftables", []):
            for kind in ("chain", "set"):
                name = item.get(kind, {}).get("name", "")
                if re.fullmatch(r"(eg|al|dn)-\d+", name):
                    nft.append(f"inet {table} {kind} {name}")
    out["nft objects"] = sorted(nft)
    return out


def processes(tag: str, workdir: str) -> dict[int, str]:
    """pid -> command line of the run's processes still alive (not this one's ancestors)."""
    mine = {os.getpid()}
    pid = os.getppid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    found = {}
    marker = f"SANDLOT_CI_RUN={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not cmd:  # a kernel thread or a zombie
            continue
        if marker in environ or workdir in cmd:
            found[int(entry.name)] = cmd.strip()[:300]
    return found


def check(snapshot: Path, tag: str, workdir: str) -> int:
    before = json.loads(snapshot.read_text())
    left = processes(tag, workdir)
    new = {k: set(v) - set(before.get(k, ())) for k, v in objects().items()}
    if any(new.values()):
        time.sleep(SETTLE_S)
        new = {k: v & set(objects()[k]) for k, v in new.items()}
        still = processes(tag, workdir)  # those gone meanwhile are reported, never killed
    else:
        still = left
    bad = False
    if left:
        bad = True
        print(f"leftovers: {len(left)} processes of the run were still running "
              f"({len(still)} killed now):")
        for pid, cmd in sorted(left.items()):
            print(f"  {pid} {cmd}")
        for pid in still:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for kind, names in new.items():
        if names:
            bad = True
            print(f"leftovers: {kind} new since the run started:")
            for name in sorted(names):
                print(f"  {name}")
    if not bad:
        print("leftovers: none")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "snapshot":
        Path(argv[1]).write_text(json.dumps(objects()))
        return 0
    if len(argv) == 4 and argv[0] == "check":
        return check(Path(argv[1]), argv[2], argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
