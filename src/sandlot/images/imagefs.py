"""A sandlot root filesystem from an OCI image: its layers unpacked (umoci), sandlot's guest
files installed (`rootfs.install_guest`, the same list a Debian template gets), packed as ext4
with `mkfs.ext4 -d` (no loop mounts)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from sandlot.errors import ImageError
from sandlot.images import oci
from sandlot.images._run import run
from sandlot.images.kernel import Kernel
from sandlot.images.rootfs import inside, install_guest

log = logging.getLogger(__name__)
MIN_DISK_MB = 2048
HEADROOM_MB = 1024  # free space a sandbox starts with beyond the image's own files


def build_image_rootfs(layout: Path, out_image: Path, kernel: Kernel,
                       guest_files: dict[str, Path], disk_mb: int | None = None
                       ) -> oci.ImageConfig:
    """Unpack the layout's image, make it a guest, write it as ext4 to `out_image`; the
    image's config, its USER checked against the image's own /etc/passwd."""
    config = oci.read_config(layout)
    with tempfile.TemporaryDirectory(dir=out_image.parent) as tmp:
        root = oci.unpack(layout, Path(tmp) / "bundle")
        user = resolve_user(root, config.user)
        if config.workdir:
            inside(root, config.workdir).mkdir(parents=True, exist_ok=True)
        install_guest(root, kernel, guest_files)
        used_mb = _used_mb(root)
        size = disk_mb or max(MIN_DISK_MB, int(used_mb * 1.3) + HEADROOM_MB)
        if size < used_mb + 64:
            raise ImageError(f"disk_mb={size} is too small for the image ({used_mb} MiB)")
        tmp_img = Path(tmp) / "rootfs.ext4"
        run(["mkfs.ext4", "-q", "-F", "-L", "sandlot", "-E", "root_owner=0:0",
             "-d", str(root), str(tmp_img), f"{size}M"])
        shutil.move(tmp_img, out_image)
    return oci.ImageConfig(env=config.env, workdir=config.workdir, user=user,
                           entrypoint=config.entrypoint, cmd=config.cmd)


def resolve_user(root: Path, user: str | None) -> str | None:
    """The image's USER as a name the guest's /etc/passwd has (commands run as it): a name is
    kept, a numeric uid becomes its name; None (root) when unset. ImageError if the image
    names a user it does not have (the guest could run nothing as it)."""
    if not user:
        return None
    name = user.split(":", 1)[0]
    entries = _passwd(root)
    if name in entries.values():
        return None if name == "root" else name
    if name.isdigit() and int(name) in entries:
        found = entries[int(name)]
        return None if found == "root" else found
    raise ImageError(f"the image's USER {user!r} is not in its /etc/passwd; sandlot runs "
                     "commands as a named user of the image")


def _passwd(root: Path) -> dict[int, str]:
    try:
        text = inside(root, "etc/passwd").read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            out[int(fields[2])] = fields[0]
    return out


def _used_mb(root: Path) -> int:
    out = run(["du", "-sxm", "--apparent-size", str(root)])
    return int(out.split()[0])
