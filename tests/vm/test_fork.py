"""Fork (issue #3, item 4) and fork hygiene (item 7): independent children, forks of forks,
snapshots of restored sandboxes; after every fork or restore the clock is right, the RNG is
reseeded and a new restore generation is visible to files, commands and running processes.

The last test restores a snapshot taken when the module started, at least 30 s later: a guest
clock left as the snapshot had it would be 30 s off; the check allows some 50 ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from snapkit import Answer, Reaper, ask, clock_error, generation, start_holder, urandom

from sandlot import ForkList, InvalidArgumentError, NotFoundError, Sandbox, Snapshot

OLD_SNAPSHOT_AGE = 30.0


@dataclass
class Parent:
    sbx: Sandbox
    answer: Answer


@pytest.fixture(scope="module")
def parent(server) -> Parent:
    sbx = Sandbox.create(env={"PARENT_VAR": "p"}, timeout=900, metadata={"suite": "fork"})
    answer = start_holder(sbx)
    sbx.files.write("/root/base.txt", "base")
    yield Parent(sbx, answer)
    sbx.kill()


@pytest.fixture(scope="module", autouse=True)
def old_snapshot(parent) -> tuple[Snapshot, float]:
    """A snapshot taken as the module starts, for the clock test at its end."""
    taken_at = time.monotonic()
    snap = parent.sbx.create_snapshot()
    snap.wait()
    yield snap, taken_at
    snap.remove()


@pytest.fixture(scope="module")
def children(parent) -> ForkList:
    kids = parent.sbx.fork(count=3)
    yield kids
    for kid in kids:
        kid.kill()


@pytest.fixture
def reap():
    reaper = Reaper()
    yield reaper
    reaper.kill_all()


def assert_clocks_right(boxes: list[Sandbox]) -> None:
    for sbx in boxes:
        error, allowed = clock_error(sbx)
        assert abs(error) <= allowed, (
            f"{sbx.sandbox_id}: clock off by {error * 1000:.0f} ms "
            f"(allowed {allowed * 1000:.0f} ms)")


def assert_fresh(boxes: list[Sandbox], not_like: list[Sandbox]) -> None:
    """Item 7 for each of `boxes`: its own /dev/urandom stream, and its own generation in
    /run/sandlot/generation, $SANDLOT_GENERATION and what a running process reads."""
    randoms = [urandom(sbx) for sbx in boxes + not_like]
    assert all(len(r) == 64 for r in randoms)
    assert len(set(randoms)) == len(randoms), "two sandboxes read the same /dev/urandom bytes"
    generations = []
    for sbx in boxes:
        info = sbx.get_info()
        assert info.generation
        assert generation(sbx) == (info.generation, info.generation)
        assert ask(sbx).generation == info.generation  # a process started before the snapshot
        generations.append(info.generation)
    others = [sbx.get_info().generation for sbx in not_like]
    assert len(set(generations + others)) == len(generations) + len(others)


def test_fork_reseeds_rng_and_sets_a_new_generation(parent, children):
    assert len(children) == 3 and children.errors == []
    assert_fresh(list(children), [parent.sbx])
    # The parent was not restored: same generation as before the fork.
    assert ask(parent.sbx) == parent.answer


def test_clocks_are_right_after_fork(parent, children):
    assert_clocks_right([*children, parent.sbx])


def test_fork_children_are_independent(parent, children):
    ids = [kid.sandbox_id for kid in children]
    assert len(set(ids)) == 3 and parent.sbx.sandbox_id not in ids
    for kid in children:
        info = kid.get_info()
        assert info.state == "running"
        assert info.metadata == {"suite": "fork"}
        assert ask(kid).memory == parent.answer.memory
        assert kid.commands.run("echo $PARENT_VAR; cat /root/base.txt").stdout == "p\nbase"

    # Each child writes its own file; the parent writes one after the fork.
    for i, kid in enumerate(children):
        kid.files.write(f"/root/child-{i}.txt", str(i))
    parent.sbx.files.write("/root/parent-later.txt", "later")
    children[0].commands.run("kill $(cat /tmp/holder.pid)", check=True)
    for i, kid in enumerate(children):
        seen = kid.commands.run("cd /root && ls child-*.txt parent-later.txt 2>/dev/null").stdout
        assert seen.split() == [f"child-{i}.txt"]
    for kid in children[1:]:
        assert ask(kid).memory == parent.answer.memory
    # The parent is unaffected by its children.
    assert parent.sbx.commands.run("cd /root && ls child-*.txt 2>/dev/null").stdout == ""
    assert ask(parent.sbx) == parent.answer


def test_fork_of_fork_and_snapshot_of_restored(parent, reap):
    child = reap(parent.sbx.fork()[0])
    child.files.write("/root/gen1.txt", "gen1")
    grandchild = reap(child.fork(count=1)[0])
    # From the disk, not the page cache: every layer of the history is there.
    uncached = "sync; echo 3 > /proc/sys/vm/drop_caches; cat /root/base.txt /root/gen1.txt"
    assert grandchild.commands.run(uncached).stdout == "basegen1"
    assert ask(grandchild).memory == parent.answer.memory
    assert not parent.sbx.files.exists("/root/gen1.txt")

    grandchild.files.write("/root/gen2.txt", "gen2")
    snap = grandchild.create_snapshot()
    snap.wait()
    restored = reap(snap.restore())
    assert restored.commands.run(uncached + " /root/gen2.txt").stdout == "basegen1gen2"
    assert ask(restored).memory == parent.answer.memory
    assert_fresh([restored], [grandchild])
    snap.remove()


def test_fork_errors(parent, reap):
    with pytest.raises(InvalidArgumentError):
        parent.sbx.fork(count=0)
    with pytest.raises(InvalidArgumentError):
        parent.sbx.fork(count=1000)
    gone = reap(parent.sbx.fork()[0])
    gone.kill()
    with pytest.raises(NotFoundError):
        gone.fork()
    assert ask(parent.sbx) == parent.answer


def test_a_stored_snapshot_forks_with_no_running_parent(parent, reap):
    """A snapshot whose sandbox is gone forks into independent children in one call, each
    resuming the process the snapshot holds; a paused sandbox forks from its paused state."""
    child = reap(parent.sbx.fork()[0])
    child.files.write("/root/stored.txt", "stored")
    snap = child.create_snapshot().wait()
    child.kill()
    kids = [reap(k) for k in snap.fork(3, env={"KID": "1"})]
    assert len(kids) == 3
    assert {k.files.read("/root/stored.txt") for k in kids} == {"stored"}
    assert {ask(k).memory for k in kids} == {parent.answer.memory}  # the process runs on
    assert_fresh(kids, [parent.sbx])
    kids[0].files.write("/root/stored.txt", "changed")
    assert kids[1].files.read("/root/stored.txt") == "stored"
    snap.remove()
    paused = reap(parent.sbx.fork()[0])
    paused.pause()
    from_pause = [reap(k) for k in paused.fork(2)]
    assert {k.info.forked_from for k in from_pause} == {paused.sandbox_id}
    assert {ask(k).memory for k in from_pause} == {parent.answer.memory}
    assert paused.get_info().state == "paused"


def test_restores_reseed_rng_and_set_a_new_generation(parent, old_snapshot, reap):
    snap, _ = old_snapshot
    first = reap(snap.restore())
    second = reap(Sandbox.create(snapshot_id=snap.snapshot_id))
    assert_fresh([first, second], [parent.sbx])
    assert ask(first).memory == parent.answer.memory
    assert not first.files.exists("/root/parent-later.txt")


@pytest.fixture(scope="module")
def old_restores(old_snapshot) -> list[Sandbox]:
    """Two restores of the module's first snapshot, made once it is OLD_SNAPSHOT_AGE s old."""
    snap, taken_at = old_snapshot
    time.sleep(max(0.0, OLD_SNAPSHOT_AGE - (time.monotonic() - taken_at)))
    assert time.monotonic() - taken_at >= OLD_SNAPSHOT_AGE
    boxes = [snap.restore(), Sandbox.create(snapshot_id=snap.snapshot_id)]
    yield boxes
    for sbx in boxes:
        sbx.kill()


def test_clock_after_restore_of_a_30_s_old_snapshot(old_restores):
    """Last in the module: its snapshot is at least 30 s old by now."""
    assert_clocks_right(old_restores)
