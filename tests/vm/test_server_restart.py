"""A server restart (graceful or SIGKILL) re-adopts running sandboxes and leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from harness import qemu_pids
from sandlot import Sandbox


def netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_restart_readopts_and_cleans(own_server):
    kw = own_server.client_kwargs()
    a = Sandbox.create(**kw)
    b = Sandbox.create(**kw)
    a.commands.run("echo kept > /root/state")
    a.commands.run("sleep 1000 >/dev/null 2>&1 &")
    pids = {a.get_info().pid, b.get_info().pid}
    assert set(qemu_pids(own_server.run_root)) == pids

    # Graceful restart: sandboxes keep running and are adopted again.
    own_server.stop(signal.SIGTERM)
    own_server.start()
    a2 = Sandbox.connect(a.sandbox_id, **kw)
    assert a2.commands.run("cat /root/state; pgrep -c -f 'sleep 1000'").stdout.split() == [
        "kept", "1"]
    assert set(qemu_pids(own_server.run_root)) == pids

    # Crash: SIGKILL the server, and let one VM die while no server watches it.
    own_server.stop(signal.SIGKILL)
    os.kill(b.info.pid, signal.SIGKILL)
    own_server.start()
    assert Sandbox.connect(a.sandbox_id, **kw).commands.run("cat /root/state").stdout == "kept\n"
    assert not Sandbox.connect(b.sandbox_id, **kw).is_running()
    assert set(qemu_pids(own_server.run_root)) == {a.info.pid}
    assert f"sl-{b.sandbox_id}" not in netns_list()

    Sandbox.connect(a.sandbox_id, **kw).kill()
    deadline = time.monotonic() + 10
    while qemu_pids(own_server.run_root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert qemu_pids(own_server.run_root) == []
    assert not {f"sl-{a.sandbox_id}", f"sl-{b.sandbox_id}"} & netns_list()
    assert sorted(p.name for p in own_server.run_root.iterdir()) == []


def test_orphan_qemu_is_killed_on_start(own_server):
    """A QEMU the database does not know (e.g. a snapshot holder of a crashed server) dies."""
    kw = own_server.client_kwargs()
    box = Sandbox.create(**kw)
    pid = box.get_info().pid
    own_server.stop(signal.SIGKILL)
    # Forget the sandbox: as if the server died between starting QEMU and recording it.
    import sqlite3

    db = sqlite3.connect(own_server.data_dir / "sandlot.db")
    db.execute("DELETE FROM sandboxes WHERE id = ?", (box.sandbox_id,))
    db.commit()
    db.close()
    own_server.start()
    deadline = time.monotonic() + 10
    while pid in qemu_pids(own_server.run_root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert qemu_pids(own_server.run_root) == []
    assert not (own_server.run_root / box.sandbox_id).exists()
