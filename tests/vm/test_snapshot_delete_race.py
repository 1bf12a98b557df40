"""A snapshot deleted while a restore from it is under way (issue #16): the restore holds the
snapshot, so it succeeds and the sandbox stays fully usable (commands, snapshots, forks); the
delete succeeds at once (a soft delete) and the data goes once no restore needs it. A restore
that asks after the delete is refused with NotFoundError, at once."""

from __future__ import annotations

import threading
import time

import pytest

from sandlot import NotFoundError, Sandbox, Snapshot

DELAYS = (0.0, 0.05, 0.1, 0.2)


def restore_while_deleting(snap: Snapshot, delay: float, kw: dict,
                           rollback: Sandbox | None = None) -> tuple[object, float]:
    """Restore `snap` (into a new sandbox, or `rollback` that one to it) in a thread and
    delete it `delay` s after the restore was sent."""
    result: dict[str, object] = {}

    def restore() -> None:
        t0 = time.monotonic()
        try:
            if rollback is not None:
                result["value"] = rollback.rollback(snap.snapshot_id)
            else:
                result["value"] = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600,
                                                 **kw)
        except Exception as e:  # noqa: BLE001 - checked below
            result["value"] = e
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=restore)
    thread.start()
    time.sleep(delay)
    assert Snapshot.delete(snap.snapshot_id, **kw) is True
    thread.join(180)
    assert not thread.is_alive(), "the restore hung"
    return result["value"], result["seconds"]


@pytest.mark.parametrize("cached", [False, True], ids=["from-store", "cached"])
def test_snapshot_deleted_while_a_restore_from_it_runs(server_factory, cached):
    # A tiny cache bound: a snapshot's hot files are evicted at the next capture, so a
    # restore fetches them from the store (the window a delete could pull them from).
    srv = server_factory(SANDLOT_POOL_SIZE="0", SANDLOT_CACHE_MB="1")
    kw = srv.client_kwargs()
    origin = Sandbox.create(timeout=900, **kw)
    restored, outcomes = [], []
    try:
        origin.files.write("/root/state.txt", "before")
        for delay in DELAYS:
            snap = origin.create_snapshot().wait()
            if not cached:
                origin.create_snapshot().wait().remove()  # evicts `snap` from the cache
            value, seconds = restore_while_deleting(snap, delay, kw)
            outcomes.append((delay, type(value).__name__, round(seconds, 2)))
            print(outcomes[-1])
            if isinstance(value, NotFoundError):
                # refused because it is gone (a time-out would be another error)
                assert "not found" in str(value) or "deleted" in str(value), (delay, value)
                continue
            assert isinstance(value, Sandbox), (delay, seconds, value)
            sbx = value
            restored.append(sbx)
            assert sbx.files.read("/root/state.txt") == "before"
            # Still a full sandbox: it snapshots, restores and forks.
            again = sbx.create_snapshot().wait()
            assert again.state == "ready", again.error
            child = again.restore()
            restored.append(child)
            assert child.commands.run("cat /root/state.txt").stdout == "before"
            forks = sbx.fork(1)
            restored.extend(forks)
            assert forks[0].commands.run("cat /root/state.txt").stdout == "before"
            assert Snapshot.get(snap.snapshot_id, **kw).state == "deleted"
            with pytest.raises(NotFoundError):
                Sandbox.create(snapshot_id=snap.snapshot_id, **kw)
            for sbx in restored:  # each holds a disk's room on the host until killed
                sbx.kill()
            restored.clear()
        # The delete landed during the restore at least once (restores take seconds here).
        assert any(kind == "Sandbox" for _, kind, _ in outcomes), outcomes
        # Every deleted snapshot's hot files went once nothing needed them.
        hot = srv.shm_root / "hot"
        kept = {i.snapshot_id for i in Snapshot.list(**kw)}
        deadline = time.monotonic() + 10
        while True:
            left = {p.name for p in hot.iterdir() if p.name.startswith("snap-")} - kept
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left
    finally:
        for sbx in restored:
            sbx.kill()
        origin.kill()


def test_snapshot_deleted_while_a_rollback_to_it_runs(server_factory):
    srv = server_factory(SANDLOT_POOL_SIZE="0", SANDLOT_CACHE_MB="1")
    kw = srv.client_kwargs()
    sbx = Sandbox.create(timeout=900, **kw)
    outcomes = []
    try:
        for delay in DELAYS:
            sbx.files.write("/root/state.txt", "snapshotted")
            snap = sbx.create_snapshot().wait()
            sbx.create_snapshot().wait().remove()  # evicts `snap` from the cache
            sbx.files.write("/root/state.txt", "changed")
            value, seconds = restore_while_deleting(snap, delay, kw, rollback=sbx)
            outcomes.append((delay, type(value).__name__, round(seconds, 2)))
            if isinstance(value, NotFoundError):  # deleted before the rollback looked
                assert "not found" in str(value) or "deleted" in str(value), (delay, value)
                assert sbx.files.read("/root/state.txt") == "changed"
                continue
            assert isinstance(value, Sandbox), (delay, seconds, value)
            assert sbx.files.read("/root/state.txt") == "snapshotted"
            again = sbx.create_snapshot().wait()
            assert again.state == "ready", again.error
            fork = sbx.fork(1)[0]
            assert fork.files.read("/root/state.txt") == "snapshotted"
            fork.kill()
        assert any(kind == "Sandbox" for _, kind, _ in outcomes), outcomes
    finally:
        sbx.kill()
