"""Snapshots across server restarts and crashes (issue #3, items 1 and 9): snapshots persist and
never expire; SIGKILL of the server mid-snapshot never leaves a bad ``ready`` snapshot, a stuck
source or an orphan QEMU; a full disk during upload ends ``failed`` with the reason."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest
from snapkit import ask, hot_dir, start_holder, wait_for

from harness import ROOT, qemu_pids
from sandlot import (
    InvalidStateError,
    NotFoundError,
    Sandbox,
    Snapshot,
    SnapshotFailedError,
)


def live_pids(kw: dict) -> set[int]:
    return {s.pid for s in Sandbox.list(**kw)}


def test_snapshots_persist_across_restarts_and_outlive_their_sandbox(own_server):
    kw = own_server.client_kwargs()
    sbx = Sandbox.create(timeout=600, **kw)
    answer = start_holder(sbx)
    sbx.files.write("/root/state.txt", "persisted")
    snap = sbx.create_snapshot(name="persist")
    snap.wait()
    # The sandbox runs out its time; the snapshot stays.
    sbx.set_timeout(1)
    wait_for(lambda: not sbx.is_running(), 30, what="the sandbox to expire")
    assert Snapshot.get("persist", **kw).state == "ready"

    # Restart, with the uncompressed copy gone too (as after a reboot): restore from the store.
    own_server.stop()
    shutil.rmtree(hot_dir(own_server.shm_root, snap.snapshot_id), ignore_errors=True)
    own_server.start()
    again = Snapshot.get("persist", **kw)
    assert (again.snapshot_id, again.state) == (snap.snapshot_id, "ready")
    assert snap.snapshot_id in {s.snapshot_id for s in Snapshot.list(**kw)}
    restored = Sandbox.create(snapshot_id="persist", **kw)
    assert ask(restored).memory == answer.memory
    assert restored.files.read("/root/state.txt") == "persisted"
    restored.kill()


def test_sigkill_mid_snapshot_never_leaves_a_bad_ready_snapshot(own_server):
    """Kill the server at three points of a snapshot of a sandbox with 100 MiB of touched memory:
    just after the call, half a second in (capturing), and once it is uploading."""
    kw = own_server.client_kwargs()
    store = own_server.data_dir / "store"
    sbx = answer = None
    outcomes = []
    for kill_at in (0.05, 0.5, "uploading"):
        if sbx is None:
            sbx = Sandbox.create(timeout=900, **kw)
            answer = start_holder(sbx, ballast_mb=100)
        snap = sbx.create_snapshot()
        if kill_at == "uploading":
            wait_for(lambda s=snap: s.refresh().state != "creating", 120, interval=0.02,
                     what="the snapshot to leave creating")
        else:
            time.sleep(kill_at)
        own_server.stop(signal.SIGKILL)
        own_server.start()

        after = Snapshot.get(snap.snapshot_id, **kw)
        source = Sandbox.connect(sbx.sandbox_id, **kw) if sbx.is_running() else None
        outcomes.append((kill_at, snap.state, after.state, source is not None))
        assert after.state in ("failed", "ready"), outcomes
        if after.state == "failed":
            assert after.error, outcomes
            assert not (store / snap.snapshot_id / "manifest.json").exists()
            with pytest.raises(InvalidStateError):
                after.restore()
        else:
            restored = after.restore()
            assert ask(restored).memory == answer.memory
            restored.kill()
        # The source is either usable, with its memory, or cleanly gone.
        if source is not None:
            assert ask(source).memory == answer.memory, outcomes
            sbx = source
        else:
            with pytest.raises(NotFoundError):
                Sandbox.connect(sbx.sandbox_id, **kw).commands.run("true")
            sbx = None
        # No orphan QEMU (a snapshot holder, or the source) survives the restart.
        assert set(qemu_pids(own_server.run_root)) == live_pids(kw), outcomes
    print("SIGKILL outcomes (when, state seen, state after restart, source alive):", outcomes)


@pytest.fixture
def tiny_store(tmp_path):
    """An 8 MiB tmpfs for the snapshot store: smaller than any snapshot."""
    d = tmp_path / "tiny-store"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_full_disk_during_upload_fails_with_the_reason(tiny_store, server_factory):
    srv = server_factory(SANDLOT_STORE=str(tiny_store))
    kw = srv.client_kwargs()
    sbx = Sandbox.create(timeout=300, **kw)
    answer = start_holder(sbx, ballast_mb=16)
    snap = sbx.create_snapshot()
    with pytest.raises(SnapshotFailedError) as exc:
        snap.wait(timeout=120)
    assert "space" in str(exc.value).lower(), str(exc.value)
    assert snap.state == "failed" and "space" in snap.error.lower()
    assert Snapshot.get(snap.snapshot_id, **kw).state == "failed"
    with pytest.raises(InvalidStateError):
        snap.restore()
    # The partial blobs and hot files are gone; the source is unharmed.
    assert not (tiny_store / snap.snapshot_id).exists()
    wait_for(lambda: not hot_dir(srv.shm_root, snap.snapshot_id).exists(), 10,
             what="the failed snapshot's hot files to go")
    # What the failed upload stored is unreferenced: the store's GC (two passes) frees it.
    # The start-up import of the templates (which fails too: they do not fit) must be over
    # first, or its pending record still references what it put.
    wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=5).json()["templates_stored"], 120,
             what="the start-up template import to end")
    assert not [p for p in tiny_store.rglob(".*") if p.is_file()], "partial writes left"
    for _ in range(2):
        subprocess.run([str(ROOT / ".venv/bin/sandlot"), "store", "gc", "--grace", "0",
                        "--data-dir", str(srv.data_dir)], check=True, capture_output=True,
                       env={**os.environ, **srv.env})
    assert shutil.disk_usage(tiny_store).used < 1 << 20, sorted(
        str(p.relative_to(tiny_store)) for p in tiny_store.rglob("*"))[:20]
    assert ask(sbx) == answer
    sbx.kill()


def test_a_snapshot_of_a_machine_type_this_qemu_lacks_is_refused_up_front(own_server):
    """The machine a snapshot was taken of is recorded with it (versioned machine type, QEMU
    version); one this host cannot run is refused with the reason, before anything starts."""
    import json
    import sqlite3

    kw = own_server.client_kwargs()
    sbx = Sandbox.create(timeout=600, **kw)
    snap = sbx.create_snapshot(name="from-the-future").wait()
    db = sqlite3.connect(own_server.data_dir / "sandlot.db")
    doc = json.loads(db.execute("SELECT doc FROM snapshots WHERE id = ?",
                                (snap.snapshot_id,)).fetchone()[0])
    assert doc["machine"]["machine_type"].startswith("pc-q35-")  # versioned, not the alias
    assert doc["machine"]["qemu_version"]
    # under TCG the guests' CPU is QEMU's `max`, as before CPU models: no features, no vendor
    assert (doc["machine"]["cpu_model"], doc["machine"]["cpu_features"],
            doc["machine"]["cpu_vendor"]) == ("max", [], "")
    taken = dict(doc["machine"])

    def record(changes: dict) -> None:
        doc["machine"] = taken | changes
        db.execute("UPDATE snapshots SET doc = ? WHERE id = ?",
                   (json.dumps(doc), snap.snapshot_id))
        db.commit()

    pids = set(qemu_pids(own_server.run_root))
    # taken with another CPU model (a KVM deployment's): refused, naming both
    record({"cpu_model": "x86-64-v4", "cpu_features": ["avx512f"]})
    with pytest.raises(InvalidStateError) as err:
        snap.restore()
    assert "CPU model x86-64-v4" in err.value.message and "max" in err.value.message
    record({"machine_type": "pc-q35-99.1", "qemu_version": "99.1.0"})
    db.close()
    with pytest.raises(InvalidStateError) as err:
        snap.restore()
    assert "pc-q35-99.1" in err.value.message and "lacks" in err.value.message
    with pytest.raises(InvalidStateError):
        sbx.rollback(snap)
    assert set(qemu_pids(own_server.run_root)) == pids
    assert sbx.is_running()
    # What the QEMU processes run: the versioned machine type.
    pid = sbx.get_info().pid
    cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    machine = cmdline[cmdline.index(b"-machine") + 1].decode()
    assert machine.startswith("pc-q35-") and machine.split(",")[0] != "q35"
    assert cmdline[cmdline.index(b"-cpu") + 1] == b"max"
    sbx.kill()
