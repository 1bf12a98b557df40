"""Helpers the VM tests share: a real sandlot server process per test or session, the
QEMU processes under a data dir. Imported by name (`from harness import ...`); pytest's
conftest modules are not importable by name once there is more than one."""

from __future__ import annotations

import os
from pathlib import Path

from sandlot import testing
from sandlot.vmm.processes import qemus_under

IMAGES_DIR = testing.IMAGES_DIR
ROOT = Path(__file__).resolve().parent.parent
Server = testing.ServerProcess
qemu_pids = qemus_under


def make_server(tmp_root: Path, name: str) -> Server:
    """A server with its own data dir and instance; the test session's servers share one
    store (the templates are given to it once)."""
    store = tmp_root.parent / "store"
    return Server(data_dir=tmp_root / f"data-{name}", instance=f"t{os.getpid()}{name}",
                  log_path=tmp_root / f"server-{name}.log",
                  extra_env={"SANDLOT_STORE": str(store)})


def cleanup(server: Server) -> None:
    server.close()
