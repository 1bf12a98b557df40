"""Snapshot storage: content-addressed, zstd-compressed, checksummed chunks with a versioned
manifest that describes the machine; a corrupted or missing chunk fails the restore with a
StorageError and leaves nothing running; deleting a snapshot does not break sandboxes
restored from it; a sandbox's disk chain stays bounded."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import zstandard
from snapkit import Reaper, ask, hot_dir, start_holder, wait_for

from harness import cleanup, make_server, qemu_pids
from sandlot import NotFoundError, Sandbox, Snapshot, StorageError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MD5_BLOB = "sync; echo 3 > /proc/sys/vm/drop_caches; md5sum /root/blob.bin | cut -d' ' -f1"


@pytest.fixture
def reap():
    reaper = Reaper()
    yield reaper
    reaper.kill_all()


def store_root(server) -> Path:
    return Path(server.env.get("SANDLOT_STORE") or server.data_dir / "store")


def manifest_of(server, key: str) -> dict:
    return json.loads((store_root(server) / "manifests" / f"{key}.json").read_text())


def digests_of(manifest: dict, name: str) -> list[str]:
    raw = zstandard.ZstdDecompressor().decompress(
        base64.b64decode(manifest["files"][name]["digests"]))
    return [raw[i:i + 32].hex() for i in range(0, len(raw), 32)]


def chunk_path(server, digest: str) -> Path:
    return store_root(server) / "chunks" / digest[:2] / digest


def chain(path: Path) -> list[str]:
    out = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", "--output=json",
                          str(path)], capture_output=True, text=True, check=True).stdout
    return [layer["filename"] for layer in json.loads(out)]


def test_chunks_are_compressed_checksummed_and_described(server, reap):
    sbx = reap(Sandbox.create(timeout=300))
    start_holder(sbx, ballast_mb=8)
    snap = sbx.create_snapshot()
    snap.wait()
    manifest = manifest_of(server, snap.snapshot_id)
    assert manifest["format"] == "1.0" and manifest["kind"] == "snapshot"
    assert set(manifest["files"]) >= {"ram", "devstate", "disk"}
    machine = manifest["machine"]
    assert machine["machine_type"].startswith("pc-q35-") and machine["qemu_version"]
    assert machine["base_mb"] == 512 and machine["device_model"] and machine["guest_proto"]
    assert snap.info.size_bytes == sum(f["size"] for f in manifest["files"].values())
    build = manifest["meta"]["build"]
    wait_for(lambda: (store_root(server) / "manifests" / f"tpl-{build}.json").exists(), 300,
             interval=1, what="the template in the store (stored at the server's start)")
    template = manifest_of(server, f"tpl-{build}")
    shared = set(digests_of(template, "ram")) & set(digests_of(manifest, "ram"))
    assert shared, "the snapshot's RAM shares no chunk with its template's"
    # It stored only what its template lacks: far less than its logical size.
    assert snap.info.stored_bytes < snap.info.size_bytes / 8
    # A chunk is zstd, and named by the SHA-256 of what it holds.
    for digest in digests_of(manifest, "devstate")[:3]:
        packed = chunk_path(server, digest).read_bytes()
        assert packed[:4] == ZSTD_MAGIC
        data = zstandard.ZstdDecompressor().decompress(packed, max_output_size=1 << 20)
        assert hashlib.sha256(data).hexdigest() == digest
    snap.remove()


def test_corrupted_or_missing_blob_fails_restore_cleanly(server, reap, tmp_path_factory):
    src = reap(Sandbox.create(timeout=300))
    answer = start_holder(src)
    corrupt, missing = src.create_snapshot(), src.create_snapshot()
    corrupt.wait()
    missing.wait()
    src.kill()
    # Evict the uncompressed copies, so restores read the blob store.
    for snap in (corrupt, missing):
        shutil.rmtree(hot_dir(server.shm_root, snap.snapshot_id))
    # A chunk of the RAM only this snapshot has (not its template's, not its sibling's).
    others = set(digests_of(manifest_of(server, missing.snapshot_id), "ram"))
    build = manifest_of(server, corrupt.snapshot_id)["meta"]["build"]
    wait_for(lambda: (store_root(server) / "manifests" / f"tpl-{build}.json").exists(), 300,
             interval=1, what="the template in the store (stored at the server's start)")
    others |= set(digests_of(manifest_of(server, f"tpl-{build}"), "ram"))
    own = [d for d in digests_of(manifest_of(server, corrupt.snapshot_id), "ram")
           if d not in others]
    ram = chunk_path(server, own[len(own) // 2])
    with open(ram, "r+b") as f:
        f.seek(ram.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    kept = set(digests_of(manifest_of(server, corrupt.snapshot_id), "devstate"))
    gone = [d for d in digests_of(manifest_of(server, missing.snapshot_id), "devstate")
            if d not in kept]
    assert gone
    for digest in gone:
        chunk_path(server, digest).unlink()

    # A server that fetches an image whole before restoring it (a lazy restore fails only
    # when the sandbox reads a bad chunk: tests/vm/test_lazy_restore.py), on the same store.
    eager = make_server(tmp_path_factory.mktemp("eager"), "eager")
    eager.extra_env.update({"SANDLOT_LAZY_RESTORE": "off", "SANDLOT_POOL_SIZE": "0"})
    eager.start()
    try:
        kw = eager.client_kwargs()
        for _ in (1, 2):  # and again: nothing of the first is kept
            with pytest.raises(StorageError) as exc:
                Sandbox.create(snapshot_id=corrupt.snapshot_id, **kw)
            assert corrupt.snapshot_id in str(exc.value) and "ram" in str(exc.value)
            assert "corrupt" in str(exc.value)
        with pytest.raises(StorageError) as exc:
            Sandbox.create(snapshot_id=missing.snapshot_id, **kw)
        assert "devstate" in str(exc.value) and "missing" in str(exc.value)
        # Nothing half-started: no sandbox, QEMU, disk or usable hot copy.
        assert [s for s in Sandbox.list(**kw) if s.state == "running"] == []
        assert not qemu_pids(eager.run_root)
        disks = eager.data_dir / "disks"
        assert not disks.exists() or not any(disks.iterdir())
        for snap in (corrupt, missing):
            assert not (hot_dir(eager.shm_root, snap.snapshot_id) / ".ok").exists()
    finally:
        cleanup(eager)

    # Put the byte back: the snapshot restores again, memory intact.
    with open(ram, "r+b") as f:
        f.seek(ram.stat().st_size // 2)
        f.write(byte)
    restored = reap(corrupt.restore())
    assert ask(restored).memory == answer.memory
    corrupt.remove()
    missing.remove()


def test_deleting_a_snapshot_keeps_its_restored_sandboxes_working(server, reap):
    src = reap(Sandbox.create(timeout=300))
    answer = start_holder(src)
    src.commands.run("head -c 4M /dev/urandom > /root/blob.bin", check=True)
    blob_md5 = src.commands.run(MD5_BLOB).stdout.strip()
    snap = src.create_snapshot()
    snap.wait()
    src.kill()
    restored = reap(snap.restore())
    assert snap.remove() is True
    assert snap.snapshot_id not in {s.snapshot_id for s in Snapshot.list()}
    with pytest.raises(NotFoundError):
        snap.restore()
    wait_for(lambda: not (store_root(server) / "manifests" / f"{snap.snapshot_id}.json")
             .exists(), 30, what="the deleted snapshot's manifest to go")

    # The restored sandbox reads its disk (page cache dropped) and memory as before.
    assert restored.commands.run(MD5_BLOB).stdout.strip() == blob_md5
    assert ask(restored).memory == answer.memory
    restored.files.write("/root/after-delete.txt", "still writable")
    # It can be snapshotted, and that snapshot outlives it.
    again = restored.create_snapshot()
    again.wait()
    restored.kill()
    # With its last user gone, the deleted snapshot's hot files go too.
    wait_for(lambda: not hot_dir(server.shm_root, snap.snapshot_id).exists(), 30,
             what="the deleted snapshot's hot files to go")
    last = reap(again.restore())
    assert last.files.read("/root/after-delete.txt") == "still writable"
    assert ask(last).memory == answer.memory
    again.remove()


def test_snapshots_and_forks_of_restored_sandboxes_keep_disk_data(reap):
    src = reap(Sandbox.create(timeout=300))
    src.commands.run("head -c 4M /dev/urandom > /root/blob.bin", check=True)
    blob_md5 = src.commands.run(MD5_BLOB).stdout.strip()
    snap = src.create_snapshot()
    snap.wait()
    restored = reap(snap.restore())
    child = reap(restored.fork()[0])
    again = restored.create_snapshot()
    again.wait()
    last = reap(again.restore())
    got = {name: sbx.commands.run(MD5_BLOB).stdout.strip()
           for name, sbx in [("restored", restored), ("fork of restored", child),
                             ("restore of its snapshot", last)]}
    assert got == dict.fromkeys(got, blob_md5)
    snap.remove()
    again.remove()


def test_disk_chain_stays_bounded(server, reap):
    sbx = reap(Sandbox.create(timeout=300))
    disk_dir = server.data_dir / "disks" / sbx.sandbox_id
    snaps = []
    for i in range(5):
        sbx.files.write(f"/root/f{i}.txt", str(i))
        snap = sbx.create_snapshot()
        snap.wait()
        snaps.append(snap)

    def newest() -> Path:
        return max(disk_dir.glob("disk-*.qcow2"), key=lambda p: int(p.stem.split("-")[1]))

    # Compaction runs in the background after each snapshot.
    wait_for(lambda: len(chain(newest())) <= 3, 60, what="the disk chain to be compacted")
    assert len(list(disk_dir.glob("*.qcow2"))) <= 3
    for snap in snaps:  # each snapshot's own disk: its layer on the template's rootfs
        assert len(chain(hot_dir(server.shm_root, snap.snapshot_id) / "disk.qcow2")) == 2
    assert sbx.commands.run("cat /root/f*.txt").stdout == "01234"
    first, last = reap(snaps[0].restore()), reap(snaps[-1].restore())
    assert first.commands.run("cat /root/f*.txt").stdout == "0"
    assert last.commands.run("cat /root/f*.txt").stdout == "01234"
    for snap in snaps:
        snap.remove()
