"""Restoring snapshots (issue #3, items 2 and 3): the three ways to restore, independence of the
restored sandboxes, restores after the source is gone, and memory/CPU/env overrides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from snapkit import Answer, Reaper, ask, start_holder

from harness import qemu_pids
from sandlot import InvalidArgumentError, Sandbox, Sandlot, Snapshot

MD5_BLOB = "sync; echo 3 > /proc/sys/vm/drop_caches; md5sum /root/blob.bin | cut -d' ' -f1"


def mem_total_kb(sbx: Sandbox) -> int:
    return int(sbx.commands.run("grep MemTotal /proc/meminfo").stdout.split()[1])


@dataclass
class Origin:
    sbx: Sandbox
    snap: Snapshot
    answer: Answer
    state: str  # /root/state.txt at snapshot time
    blob_md5: str  # /root/blob.bin (4 MiB of random data on the disk)
    mem_kb: int


@pytest.fixture(scope="module")
def origin(server) -> Origin:
    """A sandbox with a token holder, a file and a disk blob, snapshotted once; after the
    snapshot its state file changes, so restores must show the snapshot's version."""
    sbx = Sandbox.create(env={"BASE_VAR": "base"}, timeout=900, metadata={"suite": "restore"})
    answer = start_holder(sbx)
    state = "snapshot-" + answer.token[:8]
    sbx.files.write("/root/state.txt", state)
    sbx.commands.run("head -c 4M /dev/urandom > /root/blob.bin", check=True)
    blob_md5 = sbx.commands.run(MD5_BLOB, check=True).stdout.strip()
    snap = sbx.create_snapshot()
    snap.wait()
    sbx.files.write("/root/state.txt", "changed-after-snapshot")
    yield Origin(sbx, snap, answer, state, blob_md5, mem_total_kb(sbx))
    sbx.kill()


@pytest.fixture
def reap():
    reaper = Reaper()
    yield reaper
    reaper.kill_all()


def assert_resumed(sbx: Sandbox, origin: Origin) -> None:
    """`sbx` resumed where `origin.snap` was taken: same process and memory, same files, env."""
    info = sbx.get_info()
    assert info.snapshot_id == origin.snap.snapshot_id
    assert info.sandbox_id != origin.sbx.sandbox_id
    again = ask(sbx)
    assert again.memory == origin.answer.memory
    assert again.generation == info.generation != origin.answer.generation
    assert sbx.files.read("/root/state.txt") == origin.state
    assert sbx.commands.run(MD5_BLOB).stdout.strip() == origin.blob_md5
    assert sbx.commands.run("echo $BASE_VAR").stdout == "base\n"


def test_three_ways_to_restore_give_independent_sandboxes(origin, reap):
    snap = origin.snap
    a = reap(Sandbox.create(snapshot_id=snap.snapshot_id))
    b = reap(snap.restore(name="restored-b"))
    with Sandlot() as client:
        c = reap(client.snapshots.restore(origin.sbx.sandbox_id, snap.snapshot_id))
        with pytest.raises(InvalidArgumentError):
            client.snapshots.restore("sb-0000000000", snap.snapshot_id)
    boxes = [a, b, c]
    assert len({x.sandbox_id for x in boxes} | {origin.sbx.sandbox_id}) == 4
    assert b.get_info().metadata.get("name") == "restored-b"
    for sbx in boxes:
        assert_resumed(sbx, origin)

    # Independent: each writes its own file and sees only its own; killing one's process
    # leaves the others' alone; the source never sees any of it.
    for sbx in boxes:
        sbx.files.write(f"/root/mine-{sbx.sandbox_id}.txt", sbx.sandbox_id)
    a.commands.run("kill $(cat /tmp/holder.pid)", check=True)
    for sbx in boxes:
        seen = sbx.commands.run("ls /root/ | grep ^mine- || true").stdout.split()
        assert seen == [f"mine-{sbx.sandbox_id}.txt"]
    for sbx in (b, c):
        assert ask(sbx).memory == origin.answer.memory
    assert origin.sbx.commands.run("ls /root/ | grep -c ^mine- || true").stdout.strip() == "0"
    assert origin.sbx.files.read("/root/state.txt") == "changed-after-snapshot"
    assert ask(origin.sbx) == origin.answer


def test_restore_with_more_memory_env_timeout_and_metadata(origin, reap):
    snap = origin.snap
    big = reap(snap.restore_with(name="big", memory_mb=snap.info.memory_mb + 256,
                                 env={"WORKER_ID": "42"}, timeout=120,
                                 metadata={"role": "worker"}))
    info = big.get_info()
    assert info.memory_mb == snap.info.memory_mb + 256
    assert info.timeout == 120
    assert 115 <= (info.expires_at - info.created_at).total_seconds() <= 125
    assert info.metadata == {"role": "worker", "name": "big"}
    assert_resumed(big, origin)
    grown = mem_total_kb(big) - origin.mem_kb
    assert 240 * 1024 <= grown <= 256 * 1024, f"MemTotal grew by {grown} kB, not ~256 MiB"
    # The override env reaches commands run after the restore, next to the snapshot's env.
    assert big.commands.run("echo $WORKER_ID $BASE_VAR").stdout == "42 base\n"
    # The extra memory is usable: fill 300 MiB (more than the snapshot's free memory).
    fill = "python3 -c 'b = bytearray(300 << 20); b[::4096] = b\"x\" * len(b[::4096]); print(1)'"
    assert big.commands.run(fill, timeout=120).stdout == "1\n"

    # A snapshot of the grown sandbox keeps its memory, and can't grow it again.
    grown_snap = big.create_snapshot()
    grown_snap.wait()
    assert grown_snap.info.memory_mb == snap.info.memory_mb + 256
    again = reap(grown_snap.restore())
    assert again.get_info().memory_mb == snap.info.memory_mb + 256
    assert mem_total_kb(again) == mem_total_kb(big)
    assert ask(again).memory == origin.answer.memory
    assert again.commands.run("echo $WORKER_ID").stdout == "42\n"
    with pytest.raises(InvalidArgumentError):
        grown_snap.restore_with(memory_mb=snap.info.memory_mb + 384)
    grown_snap.remove()


@pytest.fixture(scope="module")
def two_cpus(origin):
    sbx = origin.snap.restore_with(cpus=2)
    yield sbx
    sbx.kill()


def test_restore_with_more_cpus(origin, two_cpus):
    assert two_cpus.get_info().cpus == 2
    assert two_cpus.commands.run("nproc").stdout == "2\n"
    assert ask(two_cpus).memory == origin.answer.memory


def test_sandbox_with_more_cpus_stays_responsive(two_cpus):
    for _ in range(4):  # each answers (how fast: bench/)
        assert two_cpus.commands.run("true", timeout=120).exit_code == 0


def test_snapshot_of_sandbox_with_more_cpus(origin, two_cpus, reap):
    snap = two_cpus.create_snapshot()
    snap.wait()
    assert snap.info.cpus == 2
    again = reap(snap.restore())
    cpus = again.commands.run("nproc; cat /sys/devices/system/cpu/online; dmesg | tail -5").stdout
    assert cpus.startswith("2\n"), cpus
    assert ask(again).memory == origin.answer.memory
    # Fewer CPUs than the snapshot's: honoured, or refused with an error that says so.
    try:
        fewer = reap(snap.restore_with(cpus=1))
    except InvalidArgumentError as e:
        assert "cpus" in str(e)
    else:
        assert fewer.commands.run("nproc").stdout == "1\n"
        assert ask(fewer).memory == origin.answer.memory
    snap.remove()


def test_overrides_that_cannot_be_honoured_fail_before_anything_starts(origin, server):
    snap = origin.snap
    before = {s.sandbox_id for s in Sandbox.list()}
    pids = set(qemu_pids(server.run_root))
    mem = snap.info.memory_mb
    for kwargs, words in [
        ({"memory_mb": mem - 128}, ("shrink", str(mem))),
        ({"memory_mb": mem + 100}, ("128",)),
        ({"cpus": 9}, ("cpus",)),
        ({"cpus": 0}, ("cpus",)),
    ]:
        with pytest.raises(InvalidArgumentError) as exc:
            snap.restore_with(**kwargs)
        message = str(exc.value)
        assert all(w in message for w in words), (kwargs, message)
    with pytest.raises(InvalidArgumentError):
        Sandbox.create(snapshot_id=snap.snapshot_id, memory_mb=mem - 128)
    assert {s.sandbox_id for s in Sandbox.list()} == before
    assert set(qemu_pids(server.run_root)) == pids


def test_restores_after_the_source_was_killed(origin, reap):
    """Last in the module: kills the module's source sandbox."""
    assert origin.sbx.kill() is True
    restored = [reap(origin.snap.restore()) for _ in range(3)]
    assert len({r.sandbox_id for r in restored}) == 3
    for i, sbx in enumerate(restored):
        assert_resumed(sbx, origin)
        sbx.files.write("/root/state.txt", f"restore-{i}")
    for i, sbx in enumerate(restored):
        assert sbx.files.read("/root/state.txt") == f"restore-{i}"
    assert len({r.get_info().generation for r in restored}) == 3
