"""A restore's first overlay comes from the bytes of one made before on the same backing file."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from sandlot.vmm import disk

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


def test_cached_overlay_is_what_qemu_img_makes(tmp_path: Path) -> None:
    backing = tmp_path / "base.qcow2"

    async def run() -> None:
        await disk._qemu_img("create", "-q", "-f", "qcow2", str(backing), "1G")
        await disk.create_overlay(tmp_path / "ref.qcow2", backing, "qcow2", 1 << 30)
        for name in ("a.qcow2", "b.qcow2"):  # a: made by qemu-img and kept; b: from the copy
            await disk.create_overlay_cached(tmp_path / name, backing, "qcow2", 1 << 30)
        other = tmp_path / "other.qcow2"
        shutil.copyfile(backing, other)
        await disk.create_overlay_cached(tmp_path / "c.qcow2", other, "qcow2", 1 << 30)

    asyncio.run(run())
    ref = (tmp_path / "ref.qcow2").read_bytes()
    assert (tmp_path / "a.qcow2").read_bytes() == ref
    assert (tmp_path / "b.qcow2").read_bytes() == ref
    assert disk.backing_file(tmp_path / "c.qcow2") == tmp_path / "other.qcow2"
    with pytest.raises(FileExistsError):  # never over an existing file
        asyncio.run(disk.create_overlay_cached(tmp_path / "b.qcow2", backing, "qcow2", 1 << 30))


def test_overlays_asked_at_once_run_qemu_img_once(tmp_path: Path, monkeypatch) -> None:
    """fork(N): N children of a new image ask for their first overlay together."""
    backing = tmp_path / "base.qcow2"
    made = []
    real = disk.create_overlay

    async def counted(path, *args):
        made.append(path)
        await real(path, *args)

    async def run() -> None:
        await disk._qemu_img("create", "-q", "-f", "qcow2", str(backing), "1G")
        monkeypatch.setattr(disk, "create_overlay", counted)
        await asyncio.gather(*(disk.create_overlay_cached(tmp_path / f"{i}.qcow2", backing,
                                                          "qcow2", 1 << 30) for i in range(6)))

    asyncio.run(run())
    assert len(made) == 1
    first = made[0].read_bytes()
    assert all((tmp_path / f"{i}.qcow2").read_bytes() == first for i in range(6))
    assert not disk._MAKING
