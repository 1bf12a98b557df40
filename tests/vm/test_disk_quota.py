"""Disk is a quota, not a race: a sandbox's guest sees a disk of its quota (`disk_mb`) and gets
ENOSPC from its own filesystem there, staying responsive; the host admits a sandbox only if
every sandbox's disk fits in its data filesystem beyond the reserve (CapacityError, 503,
otherwise), so a guest filling its disk never fills the host's: another sandbox keeps
creating, forking and snapshotting. The server's data dir is on a small loop-mounted
filesystem the test makes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from harness import IMAGES_DIR, cleanup, make_server
from sandlot import CapacityError, Sandbox

RESERVE_MB = 256
MiB = 1 << 20


def template_mb() -> int:
    """The base template's own disk: the least a sandbox of it has."""
    build = json.loads((IMAGES_DIR / "templates" / "base.json").read_text())["hash"]
    return (IMAGES_DIR / "builds" / build / "rootfs.ext4").stat().st_size >> 20


def loop_mb() -> int:
    """The data filesystem: room for the test's three sandboxes of the base template (one
    with 256 MiB more), the reserve and some metadata, and not for a fourth."""
    return 3 * template_mb() + 256 + RESERVE_MB + 512


@pytest.fixture
def small_data_fs(tmp_path):
    """A `loop_mb()` ext4 filesystem mounted under the test's tmp dir (unmounted at teardown)."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to loop-mount a filesystem")
    image, mnt = tmp_path / "data.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(loop_mb() * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode:
            subprocess.run(["umount", "-l", str(mnt)])
        image.unlink(missing_ok=True)


@pytest.fixture
def small_server(small_data_fs, tmp_path):
    """A server whose data dir (its sandboxes' disks) is on the small filesystem; sandboxes
    get the template's own disk unless they ask for more."""
    srv = dataclasses.replace(make_server(tmp_path, "dq"), data_dir=small_data_fs / "data")
    srv.extra_env.update({"SANDLOT_POOL_SIZE": "0", "SANDLOT_RESERVE_DISK_MB": str(RESERVE_MB),
                          "SANDLOT_DISK_QUOTA_MB": str(template_mb())})
    srv.start()
    try:
        yield srv
    finally:
        cleanup(srv)


def guest_mb(sbx: Sandbox, disk_mb: int) -> tuple[int, int]:
    """(the disk's size, the root filesystem's size) the guest sees, MiB, once its disk is
    `disk_mb` (it grows just after the sandbox starts)."""
    for _ in range(300):
        out = sbx.commands.run("cat /sys/block/vda/size; df -B1M --output=size / | tail -1",
                               check=True).stdout.split()
        disk, fs = int(out[0]) * 512 // MiB, int(out[1])
        if disk >= disk_mb and fs > disk_mb - 128:
            break
        time.sleep(0.1)
    return disk, fs


FILL = ("python3 -c \"import os\nb = os.urandom(1 << 20)\nwith open('/home/user/fill', 'wb') "
        "as f:\n    for _ in range({n}): f.write(b)\"")


def test_a_guest_past_its_quota_gets_enospc_and_the_others_go_on(small_server):
    kw = {**small_server.client_kwargs(), "timeout": 900}
    base = template_mb()
    quota = base + 256

    full = Sandbox.create(disk_mb=quota, **kw)
    assert full.get_info().disk_mb == quota
    disk, fs = guest_mb(full, quota)
    assert disk == quota and quota - 128 <= fs <= quota, (disk, fs)

    # Past its quota: ENOSPC from its own filesystem; it keeps answering.
    wrote = full.commands.run(FILL.format(n=quota), timeout=600, user="root")
    assert wrote.exit_code != 0 and "No space left on device" in wrote.stderr, wrote
    assert full.commands.run("sync; echo alive", timeout=120).stdout.strip() == "alive"
    with pytest.raises(Exception, match="(?i)space"):
        full.files.write("/home/user/more", b"x" * (4 * MiB))
    used = full.get_metrics()[-1]
    assert used.disk_total == quota * MiB and used.disk_used > (quota - base) * MiB // 2

    # Another sandbox creates, forks and snapshots meanwhile.
    other = Sandbox.create(**kw)
    assert other.get_info().disk_mb == base
    other.commands.run("echo kept > /home/user/note", check=True)
    children = other.fork(1)
    assert not children.errors and len(children) == 1
    assert children[0].commands.run("cat /home/user/note").stdout.strip() == "kept"
    snap = other.snapshot().wait(300)
    assert snap.state == "ready"

    # What the host cannot promise is refused before a VM starts, with a 503.
    with pytest.raises(CapacityError, match="disk_mb"):
        Sandbox.create(disk_mb=loop_mb(), **kw)
    with urllib.request.urlopen(f"{small_server.url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    promised = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("sandlot_host_disk_promised_bytes"))
    assert promised == (quota + 2 * base) * MiB

    # The full one frees space and writes again; its snapshot restores with its quota.
    full.commands.run("rm /home/user/fill", check=True, user="root")
    full.commands.run("head -c 1M /dev/urandom > /home/user/again", check=True)
    children[0].kill()
    mine = full.snapshot().wait(300)
    full.kill()
    back = Sandbox.create(snapshot_id=mine.snapshot_id, **kw)
    assert back.get_info().disk_mb == quota and guest_mb(back, quota)[0] == quota
    assert back.commands.run("wc -c < /home/user/again").stdout.strip() == str(MiB)
    back.kill()
    other.kill()
