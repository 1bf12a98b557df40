"""OCI images the tests build locally (no internet) and push to their loopback registry.

Each image is built once into an OCI layout under the shared images dir
(`<images>/test-oci/<name>-<recipe hash>`), so later sessions only push it: its digest stays
the same, and so does the template sandlot builds from it (cached by digest).

- `debian`: Debian bookworm minbase with python3 (mmdebstrap from the host's apt sources), a
  user `app`, `ENV GREETING=hello`, `WORKDIR /srv/app`, `USER app`.
- `busybox`: the static busybox alone (no python3, no bash).
- `musl`: musl's loader and libc, busybox, and a small program linked against musl.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandlot import testing
from sandlot.images.rootfs import host_apt_sources

ROOT = testing.IMAGES_DIR / "test-oci"
RECIPE_VERSION = "1"
DEBIAN_HOOKS = [
    "--customize-hook=chroot \"$1\" useradd -m -u 1000 -s /bin/bash app",
    "--customize-hook=mkdir -p \"$1/srv/app\" && chroot \"$1\" chown app:app /srv/app",
    "--customize-hook=echo debian-image > \"$1/etc/image-name\"",
]
MUSL_HELLO = '#include <stdio.h>\nint main(void) { puts("hello from musl"); return 0; }\n'


def _run(*cmd: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed: {(proc.stdout + proc.stderr)[-2000:]}")


def _layout(name: str, recipe: str, make_tar, config: list[str],
            build: bool = True) -> Path | None:
    """An OCI layout `<dir>:latest` with one layer (the tar `make_tar(path)` writes) and
    `config` (umoci config flags); built once per recipe (None if not built and not `build`)."""
    digest = hashlib.sha256((RECIPE_VERSION + recipe + " ".join(config)).encode())
    target = ROOT / f"{name}-{digest.hexdigest()[:12]}"
    if (target / "index.json").exists():
        return target
    if not build:
        return None
    ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        layer = Path(tmp) / "layer.tar"
        make_tar(layer)
        layout = Path(tmp) / "layout"
        _run("umoci", "init", "--layout", str(layout))
        _run("umoci", "new", "--image", f"{layout}:latest")
        _run("umoci", "raw", "add-layer", "--image", f"{layout}:latest", str(layer))
        _run("umoci", "config", "--image", f"{layout}:latest", *config)
        _run("umoci", "gc", "--layout", str(layout))
        layout.rename(target)
    return target


def debian_layout(build: bool = True) -> Path | None:
    """Built by `make setup` (mmdebstrap downloads its packages); the tests only use it."""

    def make(tar: Path) -> None:
        _run("mmdebstrap", "--variant=minbase", "--mode=root", "--quiet", "--format=tar",
             "--include=python3,bash", *DEBIAN_HOOKS, "bookworm", str(tar),
             *host_apt_sources())

    return _layout("debian", "debian " + " ".join(DEBIAN_HOOKS), make, [
        "--config.env=GREETING=hello",
        "--config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--config.workingdir=/srv/app", "--config.user=app", "--config.cmd=/bin/bash"],
        build)


def _busybox_tree(root: Path) -> None:
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "ls", "cat", "echo", "mkdir", "rm", "env", "id", "pwd", "sleep"):
        (root / "bin" / applet).symlink_to("busybox")
    for d in ("etc", "tmp", "root"):
        (root / d).mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")


def busybox_layout() -> Path:
    def make(tar: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            _busybox_tree(Path(tmp) / "root")
            _run("tar", "-C", str(Path(tmp) / "root"), "-cf", str(tar), ".")

    return _layout("busybox", "busybox " + _file_hash("/bin/busybox"), make, [
        "--config.env=PATH=/bin", "--config.cmd=/bin/sh"])


def musl_layout() -> Path | None:
    """None when this host cannot link against musl (no musl-gcc)."""
    if shutil.which("musl-gcc") is None:
        return None

    def make(tar: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "root"
            _busybox_tree(root)
            (root / "lib").mkdir()
            shutil.copy2("/lib/x86_64-linux-musl/libc.so", root / "lib" / "libc.musl.so")
            (root / "lib" / "ld-musl-x86_64.so.1").symlink_to("libc.musl.so")
            src = Path(tmp) / "hello.c"
            src.write_text(MUSL_HELLO)
            _run("musl-gcc", "-O2", "-o", str(root / "bin" / "hello"), str(src))
            _run("tar", "-C", str(root), "-cf", str(tar), ".")

    return _layout("musl", "musl " + _file_hash("/lib/x86_64-linux-musl/libc.so"), make, [
        "--config.env=PATH=/bin", "--config.cmd=/bin/hello"])


def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def push(layout: Path, registry: testing.RegistryServer, repo: str, tag: str = "latest") -> str:
    """Push a layout to the registry (with its login, if it has one); its reference there."""
    ref = f"{registry.host}/{repo}:{tag}"
    login = [f"--dest-creds={':'.join(registry.login)}"] if registry.login else []
    _run("skopeo", "copy", "--quiet", "--dest-tls-verify=false", *login,
         f"oci:{layout}:latest", f"docker://{ref}")
    return ref


if __name__ == "__main__":  # `make setup`: build the test images ahead of the tests
    for made in (debian_layout(), busybox_layout(), musl_layout()):
        print(f"test image: {made}")


def variant(layout: Path, tmp: Path, env: str) -> Path:
    """A copy of `layout` whose config also sets `env` (``K=V``): the same files under a new
    digest, so sandlot builds it afresh."""
    copy = tmp / f"{layout.name}-variant"
    shutil.copytree(layout, copy)
    _run("umoci", "config", "--image", f"{copy}:latest", f"--config.env={env}")
    return copy
