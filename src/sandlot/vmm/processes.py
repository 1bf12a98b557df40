"""Finding the QEMU processes sandlot started, from /proc (they outlive the server process)."""

from __future__ import annotations

from pathlib import Path


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def qemu_alive(pid: int, run_dir: Path) -> bool:
    """`pid` is the QEMU whose sockets are in `run_dir`."""
    cmd = cmdline(pid)
    return "qemu-system" in cmd and f"{run_dir}/qmp.sock" in cmd


def qemus_under(run_root: Path) -> list[int]:
    """Every QEMU whose sockets live under `run_root` (one server's, holders included)."""
    marker = f"unix:{run_root}/"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmd = cmdline(int(entry.name))
            if "qemu-system" in cmd and marker in cmd:
                pids.append(int(entry.name))
    return pids
