"""Root filesystem: mmdebstrap a minbase bookworm with the spec's packages, customize it in a
chroot, install sandlot's guest init and agent (static binaries), and pack it as an ext4 image
(no loop mounts)."""

from __future__ import annotations

import glob
import logging
import shlex
import shutil
import tempfile
from pathlib import Path

from sandlot.errors import BuildError
from sandlot.images._run import run
from sandlot.images.kernel import Kernel
from sandlot.images.spec import BASE_PACKAGES, TemplateSpec

log = logging.getLogger(__name__)
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
# Build steps run with this environment only, not the host's (whose PIP_*/SSL_* variables
# point at host paths): builds do not depend on who runs them.
CLEAN_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "
             "LANG=C.UTF-8")
def host_apt_sources() -> list[str]:
    """The host's own apt sources (never a hard-coded mirror)."""
    found = sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
    found += sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
    if Path("/etc/apt/sources.list").is_file() and Path("/etc/apt/sources.list").stat().st_size:
        found.insert(0, "/etc/apt/sources.list")
    return found


def inside(root: Path, path: str) -> Path:
    """`path` as the guest would see it under `root`, following the tree's symlinks as a
    chroot would: an image is untrusted, and a link such as ``/opt -> /etc`` must never make
    a write land outside `root`."""
    resolved = root
    parts = [p for p in path.split("/") if p not in ("", ".")]
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved.parent if resolved != root else root
            continue
        candidate = resolved / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise BuildError(f"too many symbolic links under {path} in the image")
            target = str(candidate.readlink())
            if target.startswith("/"):
                resolved = root
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved = candidate
    return resolved


def install_guest(root: Path, kernel: Kernel, guest_files: dict[str, Path]) -> None:
    """Make the tree at `root` (any image's filesystem) a sandlot guest: sandlot's init and
    agent (`guest_files`: guest path -> host file), the kernel's modules with their index
    (the host's depmod: the image may have none), the mount points init uses, and an empty
    resolv.conf and fstab (init writes the resolver at boot). The one way guest files get
    into an image's tree."""
    for d in ("dev", "proc", "sys", "run", "tmp", "opt/sandlot", "etc", "lib/modules"):
        inside(root, d).mkdir(parents=True, exist_ok=True)
    for guest, host in guest_files.items():
        target = inside(root, guest)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copyfile(host, target)
        target.chmod(0o755)
    modules = inside(root, f"lib/modules/{kernel.version}")
    shutil.rmtree(modules, ignore_errors=True)
    shutil.copytree(kernel.modules, modules, symlinks=True)
    base = modules.parent.parent.parent  # depmod -b wants the dir holding lib/modules
    run(["depmod", "-b", str(base), kernel.version])
    for name in ("etc/resolv.conf", "etc/fstab"):
        target = inside(root, name)
        if target.is_symlink() or target.is_file():
            target.unlink()
        target.write_text("")


def _hook(cmd: str) -> str:
    return f"--customize-hook={cmd}"


def build_rootfs(spec: TemplateSpec, out_image: Path, kernel: Kernel,
                 guest_files: dict[str, Path]) -> None:
    """`guest_files`: guest path -> host file of sandlot's own programs (images/guest.py)."""
    packages = sorted(set(BASE_PACKAGES + spec.packages))
    chroot = 'chroot "$1"'
    env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    hooks = [
        _hook(f'{chroot} useradd -m -s /bin/bash -G sudo user'),
        _hook('echo "user ALL=(ALL) NOPASSWD:ALL" > "$1/etc/sudoers.d/user"'),
        _hook('mkdir -p "$1/opt/sandlot" "$1/lib/modules" "$1/run/sandlot"'),
        _hook(f'cp -a {shlex.quote(str(kernel.modules))} "$1/lib/modules/{kernel.version}"'),
        _hook(f'{chroot} depmod {kernel.version}'),
    ]
    for guest, host in guest_files.items():
        hooks.append(_hook(f'install -m 0755 {shlex.quote(str(host))} "$1{guest}"'))
    if spec.pip:
        # pip in the chroot trusts what the host trusts (the host may sit behind a TLS proxy
        # whose CA only the host's bundle has); the copy is removed right after.
        pip_args = " ".join(shlex.quote(p) for p in spec.pip)
        ca = "/tmp/sandlot-host-ca.crt"
        copy_ca = f'cp {HOST_CA} "$1{ca}" && ' if Path(HOST_CA).exists() else ""
        cert = f"PIP_CERT={ca} " if copy_ca else ""
        hooks.append(_hook(
            f"{copy_ca}{chroot} env -i {CLEAN_ENV} {cert}python3 -m pip install --no-cache-dir "
            f'--break-system-packages {pip_args}; rc=$?; rm -f "$1{ca}"; exit $rc'
        ))
    for guest, host in spec.files.items():
        hooks.append(_hook(
            f'mkdir -p "$1{shlex.quote(str(Path(guest).parent))}" && '
            f'cp -a {shlex.quote(host)} "$1{shlex.quote(guest)}"'
        ))
    if spec.env:
        lines = "\\n".join(f"{k}={v}" for k, v in spec.env.items())
        hooks.append(_hook(f'printf "{lines}\\n" >> "$1/etc/environment"'))
    if spec.workdir:
        hooks.append(_hook(f'mkdir -p "$1{shlex.quote(spec.workdir)}"'))
    for cmd in spec.run:
        hooks.append(_hook(
            f"{chroot} /usr/bin/env -i {CLEAN_ENV} {env_prefix} /bin/bash -c {shlex.quote(cmd)}"))
    hooks.append(_hook(': > "$1/etc/fstab"; rm -f "$1/etc/resolv.conf"; '
                       'touch "$1/etc/resolv.conf"'))
    with tempfile.TemporaryDirectory(dir=out_image.parent) as tmp:
        root = Path(tmp) / "root"
        cmd = ["mmdebstrap", "--variant=minbase", "--mode=root", "--quiet",
               f"--include={','.join(packages)}", *hooks, "bookworm", str(root),
               *host_apt_sources()]
        try:
            run(cmd)
        except BuildError as first:
            # A package mirror hiccup is the usual cause: one more try before giving up.
            log.warning("mmdebstrap failed, retrying once: %s", first.message[-300:])
            shutil.rmtree(root, ignore_errors=True)
            run(cmd)
        tmp_img = Path(tmp) / "rootfs.ext4"
        run(["mkfs.ext4", "-q", "-F", "-L", "sandlot", "-E", "root_owner=0:0",
             "-d", str(root), str(tmp_img), f"{spec.disk_mb}M"])
        shutil.move(tmp_img, out_image)
