"""Two hosts that built one template separately (same spec, same hash, different root
filesystems: builds are not reproducible) share a store: the second takes the store's build,
so a snapshot is restored over the root filesystem it was taken on, whichever host took it."""

from __future__ import annotations

import os

from sandlot.config import Settings
from sandlot.runtime.base import Image
from sandlot.runtime.images import BUILD_FILES, IMAGE_FILES, LOCAL_IMAGE, ImageStore
from sandlot.vmm.description import MachineDescription

BUILD = "0123456789abcdef-test"


def make_build(images, seed: bytes) -> None:
    build = images / "builds" / BUILD
    (build / LOCAL_IMAGE).mkdir(parents=True)
    for name, f in BUILD_FILES.items():
        (build / f).write_bytes(seed + name.encode() + os.urandom(200_000))
    for name, f in IMAGE_FILES.items():
        if name != "dimm":
            (build / LOCAL_IMAGE / f).write_bytes(seed + name.encode() + os.urandom(100_000))


async def test_a_host_with_another_build_of_a_template_takes_the_stores(tmp_path) -> None:
    store = str(tmp_path / "store")
    machine = MachineDescription(machine_type="pc-q35-7.2", qemu_version="7.2.0",
                                 device_model="m", accel="tcg", base_mb=512)
    image = Image(key=f"tpl-{BUILD}", build=BUILD, machine=machine)
    a = ImageStore(Settings(data_dir=tmp_path / "a", images_dir=tmp_path / "ia", store=store))
    b = ImageStore(Settings(data_dir=tmp_path / "b", images_dir=tmp_path / "ib", store=store))
    make_build(tmp_path / "ia", b"a")
    make_build(tmp_path / "ib", b"b")
    assert await a.import_template(image, {"name": "base", "hash": BUILD})
    rootfs_a = (a.build_dir(BUILD) / BUILD_FILES["rootfs"]).read_bytes()

    assert not await b.import_template(image, {"name": "base", "hash": BUILD})  # not stored
    for f in BUILD_FILES.values():
        assert (b.build_dir(BUILD) / f).read_bytes() == (a.build_dir(BUILD) / f).read_bytes()
    ram = b.local_image(BUILD) / IMAGE_FILES["ram"]
    assert ram.read_bytes() == (a.local_image(BUILD) / IMAGE_FILES["ram"]).read_bytes()
    assert (b.build_dir(BUILD) / BUILD_FILES["rootfs"]).read_bytes() == rootfs_a
    # Checked once: the next start does not hash the root filesystem again.
    assert not await b.reconcile_build(image)
    assert not await a.reconcile_build(image)  # a's is the store's
