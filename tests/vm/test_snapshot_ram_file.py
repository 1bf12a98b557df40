"""A snapshot is stored from its capture's buffer and is ready before its RAM file is written
(runtime/capture.py): the file written afterwards is the stored image, byte for byte; a
restore right after `ready`, while it is still written, does not wait for it (it maps the file
the capture was taken over and gets the captured pages: runtime/unwritten.py) and holds the
snapshot's memory; and so does a snapshot of that restored sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from snapkit import Reaper, ask, hot_dir, start_holder, wait_for

from sandlot import Sandbox
from sandlot.storage.objects import LocalObjectStore
from sandlot.storage.store import Store


@pytest.fixture
def reap():
    reaper = Reaper()
    yield reaper
    reaper.kill_all()


def stored_ram(server, key: str, out: Path) -> bytes:
    root = Path(server.env.get("SANDLOT_STORE") or server.data_dir / "store")
    if str(root).startswith("s3://"):
        pytest.skip("the session's store is S3")
    store = Store(LocalObjectStore(root))
    asyncio.run(store.fetch(key, {"ram": out}))
    return out.read_bytes()


def maps(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith("/" + name) for line in f)


def test_ram_file_written_after_the_upload_is_the_stored_image(server, reap, tmp_path):
    sbx = reap(Sandbox.create(timeout=600))
    before = start_holder(sbx, ballast_mb=96)  # its RAM file takes a while to write
    snap = sbx.create_snapshot()
    snap.wait()
    assert snap.state == "ready"
    # At once: the RAM file is still being written; the restore does not wait for it.
    child = reap(Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600))
    assert maps(child.get_info().pid, "ram.base"), "the restore waited for the RAM file"
    assert ask(child).memory == before.memory
    ram = hot_dir(server.shm_root, snap.snapshot_id) / "ram"
    wait_for(lambda: (ram.parent / ".ok").exists(), timeout=60, what="the RAM file")
    assert ram.read_bytes() == stored_ram(server, snap.snapshot_id, tmp_path / "ram")

    # A snapshot of the restored sandbox: its RAM source is the file written after the upload.
    again = child.create_snapshot()
    again.wait()
    assert again.state == "ready"
    grandchild = reap(Sandbox.create(snapshot_id=again.snapshot_id, timeout=600))
    assert ask(grandchild).memory == before.memory
    ram = hot_dir(server.shm_root, again.snapshot_id) / "ram"
    wait_for(lambda: (ram.parent / ".ok").exists(), timeout=60, what="the RAM file")
    assert ram.read_bytes() == stored_ram(server, again.snapshot_id, tmp_path / "ram2")
    for s in (snap, again):
        s.remove()
