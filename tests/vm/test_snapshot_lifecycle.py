"""Snapshots of a running sandbox (issue #3, items 1, 5 and 6): created at once while the sandbox
keeps running, states and waiting, names, lookup and deletion, and rollback in place."""

from __future__ import annotations

import secrets
import time

import pytest
from snapkit import Reaper, ask, clock_error, generation, start_holder

from sandlot import (
    ConflictError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    Sandbox,
    Snapshot,
    WaitTimeoutError,
)


@pytest.fixture(scope="module")
def box(server):
    """A sandbox with the token holder running; the tests of this module snapshot it in turn."""
    sbx = Sandbox.create(timeout=900, metadata={"suite": "snapshot_lifecycle"})
    answer = start_holder(sbx)
    yield sbx, answer
    sbx.kill()


@pytest.fixture
def reap():
    reaper = Reaper()
    yield reaper
    reaper.kill_all()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def test_what_follows_the_snapshot_call_is_not_in_it(box, reap):
    """The call returns at once, but the snapshot is of the sandbox as it was when asked:
    a command and a file write sent right after it run once it is captured."""
    sbx, _ = box
    sbx.files.write("/root/before.txt", "kept")
    snap = sbx.create_snapshot()
    sbx.commands.run("rm /root/before.txt", check=True)
    sbx.files.write("/root/after.txt", "not in the snapshot")
    snap.wait(timeout=120)
    restored = reap(snap.restore())
    assert restored.files.read("/root/before.txt") == "kept"
    assert not restored.files.exists("/root/after.txt")


def test_create_snapshot_returns_at_once_and_the_sandbox_keeps_running(box):
    sbx, answer = box
    sbx.files.write("/root/state.txt", "at-snapshot")

    snap = sbx.create_snapshot()
    assert snap.state == "creating"  # answered once captured, before it is stored
    assert snap.snapshot_id.startswith("snap-")
    assert snap.info.sandbox_id == sbx.sandbox_id

    # While the snapshot is being stored the sandbox answers commands, and the snapshot can be
    # neither restored nor waited for past a short timeout yet. (A small capture may already
    # be stored by now: then there is nothing to wait for.)
    assert sbx.commands.run("echo alive").stdout == "alive\n"
    try:
        snap.wait(timeout=0.01)
    except WaitTimeoutError:
        pass  # still being stored: the usual case
    else:
        assert snap.state == "ready"
    if snap.refresh().state != "ready":
        try:  # refused while it is stored; it may have become ready since the refresh
            early = snap.restore()
        except InvalidStateError:
            pass
        else:
            assert snap.refresh().state == "ready"
            early.kill()

    states = [snap.state]
    deadline = time.monotonic() + 120
    while snap.state not in ("ready", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
        if snap.refresh().state != states[-1]:
            states.append(snap.state)
    assert states[-1] == "ready", f"states seen: {states}, error: {snap.error}"
    order = ["creating", "uploading", "ready"]
    assert [order.index(s) for s in states] == sorted(order.index(s) for s in states), states

    assert snap.wait(timeout=5) is snap
    info = snap.info
    assert info.error is None and info.ready_at is not None
    assert info.memory_mb == 512 and info.cpus == 1 and info.template == "base"
    assert 0 < info.stored_bytes < info.size_bytes
    # The server reports the pause it measured (stop -> running again); its length: bench/.
    assert info.pause_ms is not None

    # The source was not restored: same process, same memory, same generation, right clock.
    assert ask(sbx) == answer
    assert sbx.commands.run("cat /root/state.txt").stdout == "at-snapshot"
    error, slack = clock_error(sbx)
    assert abs(error) <= slack, f"source clock off by {error * 1000:.0f} ms after a snapshot"

    listed = {s.snapshot_id: s for s in Snapshot.list(sandbox_id=sbx.sandbox_id)}
    assert listed[snap.snapshot_id].state == "ready"
    assert snap.snapshot_id in {s.snapshot_id for s in Snapshot.list()}
    assert snap.remove() is True


def test_named_snapshots(box):
    sbx, _ = box
    first, second = unique("first"), unique("second")

    snap = sbx.create_snapshot(name=first)
    assert snap.name == first
    snap.wait()
    assert Snapshot.get(first).snapshot_id == snap.snapshot_id
    assert Snapshot.get(snap.snapshot_id).name == first

    # Names are unique: a clash is a ConflictError and creates nothing.
    before = {s.snapshot_id for s in Snapshot.list(sandbox_id=sbx.sandbox_id)}
    with pytest.raises(ConflictError):
        sbx.create_snapshot(name=first)
    assert {s.snapshot_id for s in Snapshot.list(sandbox_id=sbx.sandbox_id)} == before
    with pytest.raises(InvalidArgumentError):
        sbx.create_snapshot(name="Not A Valid Name!")

    other = sbx.snapshot()  # the alias
    assert other.name is None
    other.wait()
    assert other.save_named(second) is other and other.name == second
    assert Snapshot.get(second).snapshot_id == other.snapshot_id
    with pytest.raises(ConflictError):
        other.save_named(first)
    assert other.refresh().name == second
    names = {s.name for s in Snapshot.list()}
    assert {first, second} <= names

    # Unknown names and ids are NotFoundError everywhere.
    with pytest.raises(NotFoundError):
        Snapshot.get("no-such-snapshot")
    with pytest.raises(NotFoundError):
        Snapshot.get("snap-0000000000")
    with pytest.raises(NotFoundError):
        Sandbox.create(snapshot_id="no-such-snapshot")

    assert Snapshot.delete(first) is True
    with pytest.raises(NotFoundError):
        Snapshot.get(first)
    assert Snapshot.delete(first) is False
    assert first not in {s.name for s in Snapshot.list()}
    assert snap.snapshot_id not in {s.snapshot_id for s in Snapshot.list()}
    with pytest.raises(NotFoundError):
        Sandbox.create(snapshot_id=snap.snapshot_id)
    # A deleted snapshot's name is free again.
    assert other.save_named(first).name == first
    assert Snapshot.delete(other.snapshot_id) is True


def test_deleted_snapshot_reads_as_deleted(box):
    """Deletion is a soft delete: the snapshot object sees state ``deleted``."""
    sbx, _ = box
    snap = sbx.create_snapshot()
    snap.wait()
    assert Snapshot.delete(snap.snapshot_id) is True
    assert snap.refresh().state == "deleted"


def test_rollback_returns_the_sandbox_to_the_snapshot(box, reap):
    sbx, answer = box
    sbx.files.write("/root/state.txt", "before")
    snap = sbx.create_snapshot(name=unique("rollback"))
    snap.wait()
    generation_before = sbx.get_info().generation

    # Change files and kill the token holder after the snapshot.
    sbx.files.write("/root/state.txt", "after")
    sbx.files.write("/root/new.txt", "new")
    sbx.commands.run("kill $(cat /tmp/holder.pid)", check=True)

    assert sbx.rollback(snap) is sbx
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.state == "running"
    assert info.snapshot_id == snap.snapshot_id
    assert info.metadata == {"suite": "snapshot_lifecycle"}
    assert sbx.sandbox_id in {s.sandbox_id for s in Sandbox.list()}
    assert sbx.files.read("/root/state.txt") == "before"
    assert not sbx.files.exists("/root/new.txt")
    again = ask(sbx)
    assert again.memory == answer.memory  # the killed process is back with its memory
    assert info.generation != generation_before
    assert again.generation == info.generation
    assert generation(sbx) == (info.generation, info.generation)
    error, allowed = clock_error(sbx)
    assert abs(error) <= allowed, f"clock off by {error * 1000:.0f} ms after a rollback"

    # By name, a second time: the snapshot is unchanged by the first rollback.
    sbx.files.write("/root/state.txt", "again")
    sbx.rollback(snap.name)
    assert sbx.files.read("/root/state.txt") == "before"

    # Unknown snapshot: a typed error, and the sandbox is left as it was.
    sbx.files.write("/root/state.txt", "kept")
    with pytest.raises(NotFoundError):
        sbx.rollback("no-such-snapshot")
    assert sbx.files.read("/root/state.txt") == "kept"
    assert ask(sbx).memory == answer.memory
    snap.remove()
