"""A stored snapshot forked over a deployment of two `sandlot serve` hosts (a real PostgreSQL
and a real S3 store, started by the tests on loopback), with no running parent: its children
start on both hosts, one of which has never seen the snapshot (nothing of it in its cache:
it fetches it from the store)."""

from __future__ import annotations

import pytest
from snapkit import ask, start_holder

from harness import Server, cleanup, start_cluster
from sandlot import Sandbox, Sandlot, Snapshot
from sandlot.errors import CapacityError

SLOTS = 2  # per host: four children fill both


@pytest.fixture(scope="module")
def pair(s3, postgres, tmp_path_factory):
    hosts = start_cluster(s3, postgres, tmp_path_factory, {"a": SLOTS, "b": SLOTS}, "sfork",
                          SANDLOT_HEARTBEAT="1")
    yield hosts
    for srv in hosts.values():
        cleanup(srv)


def seen(srv: Server, snapshot_id: str) -> list[str]:
    """What a host keeps of a snapshot on its disk and in its memory files."""
    return [str(p) for root in (srv.data_dir, srv.shm_root) if root.exists()
            for p in root.rglob(f"*{snapshot_id}*")]


def test_a_stored_snapshot_forks_over_two_hosts_one_never_saw_it(pair) -> None:
    a, b = pair["a"], pair["b"]
    admin = Sandlot(**b.client_kwargs())
    admin.hosts.drain("host-b")  # the sandbox the snapshot is of runs on a
    try:
        src = Sandbox.create(timeout=600, **a.client_kwargs())
    finally:
        admin.hosts.activate("host-b")
    assert src.info.host == "host-a"
    answer = start_holder(src)  # a process whose state is in memory only
    src.files.write("/root/state.txt", "stored on a")
    snap = src.create_snapshot(name="fork-me").wait()
    src.kill()  # no parent from here on
    assert seen(b, snap.snapshot_id) == []

    # asked of b, the host that never saw it: four children, two per host
    kids = Snapshot.get("fork-me", **b.client_kwargs()).fork(4, env={"KID": "1"}, timeout=600)
    try:
        assert kids.errors == [] and len(kids) == 4
        hosts = sorted(k.info.host for k in kids)
        assert hosts == ["host-a", "host-a", "host-b", "host-b"]
        assert seen(b, snap.snapshot_id)  # fetched from the store for its children
        for k in kids:
            assert k.info.snapshot_id == snap.snapshot_id and k.info.forked_from is None
            assert k.files.read("/root/state.txt") == "stored on a"
            assert ask(k).memory == answer.memory  # the process goes on where it was
            assert k.commands.run("echo $KID").stdout == "1\n"
        # independent: a write in one child is not seen in another, on either host
        on_a = [k for k in kids if k.info.host == "host-a"]
        on_b = [k for k in kids if k.info.host == "host-b"]
        on_b[0].files.write("/root/state.txt", "changed in a child on b")
        assert {k.files.read("/root/state.txt") for k in (*on_a, on_b[1])} == {"stored on a"}
        # the deployment is full: a fifth child is that child's error, not a failed call
        with pytest.raises(CapacityError):
            Snapshot.get("fork-me", **a.client_kwargs()).fork(1)
    finally:
        for k in kids:
            k.kill()
    snap.remove()
