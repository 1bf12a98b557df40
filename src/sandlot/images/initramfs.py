"""Initramfs: static busybox, the virtio modules, and a script that mounts /dev/vda and
switch_roots into sandlot's init."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandlot.errors import BuildError
from sandlot.images.kernel import Kernel

BUSYBOX = Path("/bin/busybox")
# Load order matters: each module's dependencies come first.
MODULES = [
    "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
    "virtio_blk", "virtio_console", "virtio-rng", "failover", "net_failover", "virtio_net",
]

INIT_SCRIPT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in {modules}; do insmod /lib/modules/$m.ko 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
mkdir -p /newroot
mount -t ext4 -o rw,noatime /dev/vda /newroot || {{
  echo "sandlot: cannot mount /dev/vda"; sleep 5; poweroff -f; }}
umount /proc /sys
mount --move /dev /newroot/dev 2>/dev/null || umount /dev
exec switch_root /newroot /sbin/sandlot-init
"""


def build_initramfs(kernel: Kernel, out: Path) -> Path:
    if not BUSYBOX.exists():
        raise BuildError("busybox-static is not installed (/bin/busybox missing)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "lib/modules", "newroot"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for name in MODULES:
            found = list(kernel.modules.rglob(f"{name}.ko*"))
            if not found:
                raise BuildError(f"kernel module {name} not found in {kernel.modules}")
            data = found[0].read_bytes()
            if found[0].suffix != ".ko":
                raise BuildError(f"compressed module {found[0]} is not supported")
            (root / "lib" / "modules" / f"{name}.ko").write_bytes(data)
        init = root / "init"
        init.write_text(INIT_SCRIPT.format(modules=" ".join(MODULES)))
        init.chmod(0o755)
        files = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
        cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files,
                              capture_output=True)
        if cpio.returncode:
            raise BuildError(f"cpio failed: {cpio.stderr.decode()[-500:]}")
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_bytes(gzip.compress(cpio.stdout, compresslevel=6))
        tmp_out.replace(out)
    return out
