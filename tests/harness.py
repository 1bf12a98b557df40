"""Helpers the VM tests share: a real sandlot server process per test or session, the
QEMU processes under a data dir. Imported by name (`from harness import ...`); pytest's
conftest modules are not importable by name once there is more than one."""

from __future__ import annotations

import asyncio
import random
import re
import secrets
from pathlib import Path

from sandlot import testing
from sandlot.vmm.processes import qemus_under

IMAGES_DIR = testing.IMAGES_DIR
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
Server = testing.ServerProcess
qemu_pids = qemus_under
# This run's tag: every server's instance starts with it, so what a server names host-wide
# (run dir, tmpfs files, network namespaces and veth aliases, VM uids, cgroups) is this run's
# alone, even with another run on the host (a pid may repeat across pid namespaces).
RUN = "t" + secrets.token_hex(3)


def make_server(tmp_root: Path, name: str) -> Server:
    """A server with its own data dir and instance (`RUN` + `name`: at most 16 characters of
    [a-z0-9] in all, its network owner tag); the test session's servers share one store (the
    templates are given to it once)."""
    store = tmp_root.parent / "store"
    instance = RUN + name
    if not re.fullmatch(r"[a-z0-9]{1,16}", instance):
        raise ValueError(f"instance {instance!r}: the name must be 1-9 of [a-z0-9]")
    return Server(data_dir=tmp_root / f"data-{name}", instance=instance,
                  log_path=tmp_root / f"server-{name}.log",
                  extra_env={"SANDLOT_STORE": str(store), "SANDLOT_METRICS_INTERVAL": "1"})


def cleanup(server: Server) -> None:
    server.close()


def sparse_file(path: Path, size: int, data: dict[int, bytes]) -> Path:
    """A sparse file of `size` bytes holding `data` (offset -> bytes)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, chunk in data.items():
            f.seek(offset)
            f.write(chunk)
    return path


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def gc_under_concurrent_uploads(store, tmp: Path, count: int, mib: int, gcs: int) -> None:
    """Upload `count` images sharing half their chunks while GC runs `gcs` times with no
    grace, after an image was deleted; every image must then read back whole."""
    from sandlot.storage.gc import collect_garbage
    from sandlot.storage.store import Source

    half = mib * MiB // 2
    common = rand(half, 9)
    files = [sparse_file(tmp / f"f{i}", 2 * half, {0: common, half: rand(half // 2, 10 + i)})
             for i in range(count)]
    await store.put("doomed", "snapshot", {"f": Source(files[0])}, {}, {})
    await store.delete("doomed")

    async def uploads() -> None:
        for i, f in enumerate(files):
            await store.put(f"k{i}", "snapshot", {"f": Source(f)}, {}, {})

    async def collect() -> None:
        for _ in range(gcs):
            await collect_garbage(store, grace=0)
            await asyncio.sleep(0)

    await asyncio.gather(uploads(), collect())
    for _ in range(2):
        await collect_garbage(store, grace=0)
    for i, f in enumerate(files):
        out = tmp / f"out{i}"
        await store.fetch(f"k{i}", {"f": out})
        assert out.read_bytes() == f.read_bytes()
