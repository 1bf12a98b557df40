"""Memory of QEMU processes, from /proc/<pid>/smaps and smaps_rollup (values in MiB), and
the CPU a process used."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class QemuMemory:
    pss_mib: float  # the whole process (smaps_rollup Pss)
    ram_private_mib: float  # Private_Clean + Private_Dirty of the guest RAM file mapping(s)
    ram_pss_mib: float
    ram_rss_mib: float
    jit_pss_mib: float  # anonymous rwx mappings: TCG's translated-code cache (0 under KVM)


def _is_mapping_header(parts: list[str]) -> bool:
    return len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":")


def qemu_memory(pid: int, ram_dir: Path) -> QemuMemory:
    """Memory of QEMU `pid`; guest RAM is the file mappings under `ram_dir` (the hot cache on
    /dev/shm) named ``ram`` or ``ram.dimm``."""
    prefix = str(ram_dir).rstrip("/") + "/"
    private = pss = rss = jit = 0
    in_ram = in_jit = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if _is_mapping_header(parts):
                path = parts[5] if len(parts) > 5 else ""
                in_ram = path.startswith(prefix) and path.rsplit("/", 1)[-1] in ("ram", "ram.dimm")
                in_jit = not path and parts[1] == "rwxp"
                continue
            if in_jit and parts[0] == "Pss:":
                jit += int(parts[1])
            if not in_ram:
                continue
            if parts[0] in ("Private_Clean:", "Private_Dirty:"):
                private += int(parts[1])
            elif parts[0] == "Pss:":
                pss += int(parts[1])
            elif parts[0] == "Rss:":
                rss += int(parts[1])
    return QemuMemory(pss_mib=process_pss_kib(pid) / 1024, ram_private_mib=private / 1024,
                      ram_pss_mib=pss / 1024, ram_rss_mib=rss / 1024, jit_pss_mib=jit / 1024)


def process_pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def file_allocated_mib(path: Path) -> float:
    """Space a (sparse) file really takes, e.g. a snapshot RAM file on tmpfs."""
    return path.stat().st_blocks * 512 / 2**20


def process_cpu_ms(pid: int) -> float:
    """CPU (user + system) a process has used so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
