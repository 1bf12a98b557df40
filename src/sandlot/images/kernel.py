"""Guest kernel: Debian's cloud kernel package, fetched with apt and unpacked."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import BuildError
from sandlot.images._run import run

META_PACKAGE = "linux-image-cloud-amd64"


@dataclass(frozen=True)
class Kernel:
    version: str
    vmlinuz: Path
    modules: Path  # .../lib/modules/<version>


def resolve_package() -> str:
    """The concrete kernel package the cloud meta-package points at."""
    out = run(["apt-cache", "depends", META_PACKAGE])
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise BuildError(f"cannot resolve {META_PACKAGE}; run apt-get update")


def ensure_kernel(cache_dir: Path) -> Kernel:
    """Download and unpack the kernel once; later calls reuse the unpacked tree."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for done in sorted(cache_dir.glob("*/.done")):
        return _kernel_at(done.parent)
    package = resolve_package()
    version = package.removeprefix("linux-image-")
    target = cache_dir / version
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        run(["apt-get", "download", package], cwd=tmp)
        debs = glob.glob(os.path.join(tmp, "*.deb"))
        if not debs:
            raise BuildError(f"apt-get download {package} produced nothing")
        unpacked = Path(tmp) / "root"
        run(["dpkg-deb", "-x", debs[0], str(unpacked)])
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        shutil.move(str(next((unpacked / "boot").glob("vmlinuz-*"))), target / "vmlinuz")
        mods = next((unpacked / "lib" / "modules").iterdir())
        shutil.move(str(mods), target / "modules")
    (target / ".done").write_text(version)
    return _kernel_at(target)


def _kernel_at(path: Path) -> Kernel:
    return Kernel(version=(path / ".done").read_text().strip(), vmlinuz=path / "vmlinuz",
                  modules=path / "modules")
