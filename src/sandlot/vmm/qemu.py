"""The QEMU binary on this host: its version and the machine types it can run.

A snapshot loads only into the machine type it was taken with. Plain ``q35`` is an alias that
moves with every QEMU release, so sandlot always runs a versioned type (``pc-q35-7.2``) and
records it, with QEMU's version, in every snapshot (vmm/description.py).
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass

from sandlot.errors import VmmError

QEMU = "qemu-system-x86_64"
MACHINE_FAMILY = "q35"


@dataclass(frozen=True)
class QemuInfo:
    version: str  # e.g. "7.2.22"
    machine_types: frozenset[str]  # every type `-machine help` lists (aliases resolved too)
    default_q35: str  # the versioned type `q35` stands for here, e.g. "pc-q35-7.2"


def _run(*args: str) -> str:
    try:
        return subprocess.run([QEMU, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise VmmError(f"cannot run {QEMU} {' '.join(args)}: {e}") from e


def parse_machine_help(text: str) -> tuple[frozenset[str], str | None]:
    """(machine types, the versioned type `q35` is an alias of) from `-machine help`."""
    types = set()
    q35 = None
    for line in text.splitlines():
        parts = line.split()
        if not parts or line.startswith("Supported"):
            continue
        types.add(parts[0])
        alias = re.search(r"\(alias of ([\w.-]+)\)", line)
        if parts[0] == MACHINE_FAMILY and alias:
            q35 = alias.group(1)
    return frozenset(types), q35


@functools.cache
def qemu_info() -> QemuInfo:
    """Asked of the binary once per process."""
    version = re.search(r"version (\d+\.\d+(?:\.\d+)?)", _run("--version"))
    types, q35 = parse_machine_help(_run("-machine", "help"))
    if version is None or q35 is None:
        raise VmmError(f"cannot tell {QEMU}'s version or its q35 machine type")
    return QemuInfo(version=version.group(1), machine_types=types, default_q35=q35)
