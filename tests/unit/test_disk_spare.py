"""A capture's next disk overlay is made ahead (DiskChain.prepare_next, after the last
capture), so the capture only opens it: the file it opens is the overlay it would have made,
on the current top and of the disk's size; one made for another size is not used."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from sandlot.vmm.disk import DiskChain, backing_file

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")
MiB = 1 << 20


class FakeMachine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def execute(self, command: str, args: dict | None = None):
        self.calls.append((command, args or {}))
        return {}


def virtual_size(path) -> int:
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["virtual-size"]


async def test_the_next_overlay_made_ahead_is_the_one_opened(tmp_path) -> None:
    source = tmp_path / "root.raw"
    source.write_bytes(bytes(MiB))
    chain = DiskChain(dir=tmp_path / "disks", source=source, size=64 * MiB, source_fmt="raw")
    await chain.create()
    await chain.prepare_next()
    spare = chain._spare()
    assert spare.exists()
    machine = FakeMachine()
    await chain.open_next(machine)
    opened = tmp_path / "disks" / "disk-1.qcow2"
    assert not spare.exists() and opened.exists()
    assert backing_file(opened) == chain.top and virtual_size(opened) == 64 * MiB
    assert machine.calls[0][1]["file"]["filename"] == str(opened)
    await chain.drop_next(machine)

    await chain.prepare_next()
    chain.size = 128 * MiB  # the disk grew: the spare is for another size
    await chain.open_next(machine)
    assert virtual_size(opened) == 128 * MiB
    await chain.prepare_next()
    assert [p.name for p in (tmp_path / "disks").glob("spare-*")] == [chain._spare().name]
