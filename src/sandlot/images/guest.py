"""The guest's own programs: sandlot's agent and init, built from their Go sources
(`src/sandlot/guest/go`, standard library only) as static binaries, so that a guest image needs
nothing of sandlot's: no Python, no libc, no shell tools.

Builds are cached under `<images>/guest/<digest>/`, keyed by the sources and the Go version.
The binaries are reproducible (`-trimpath`, no build id): the same sources and toolchain give
the same bytes on every host, and the template hash covers those bytes.

The host's one Go program, `sandlot-jail` (`src/sandlot/vmm/go`: what starts a confined QEMU,
vmm/jail.py), is built the same way and cached beside them (`<images>/guest/host-<digest>/`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandlot.errors import BuildError

GO_DIR = Path(__file__).resolve().parent.parent / "guest" / "go"
HOST_GO_DIR = Path(__file__).resolve().parent.parent / "vmm" / "go"
JAIL_HELPER = "sandlot-jail"  # its Go package: HOST_GO_DIR / "jail"
# Where each binary goes in the guest, and its Go package (a directory under GO_DIR).
BINARIES = {
    "/opt/sandlot/sandlot-agent": "agent",
    "/sbin/sandlot-init": "init",
}
GO = "go"
BUILD_FLAGS = ["-trimpath", "-buildvcs=false", "-ldflags=-s -w -buildid="]


def _sources_digest(go_version: str, go_dir: Path = GO_DIR) -> str:
    h = hashlib.sha256(go_version.encode())
    files = sorted(p for p in go_dir.rglob("*")
                   if p.is_file() and (p.name == "go.mod" or (
                       p.suffix == ".go" and not p.name.endswith("_test.go"))))
    for p in files:
        h.update(str(p.relative_to(go_dir)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def go_env(cache_dir: Path) -> dict[str, str]:
    """The Go toolchain's environment: static, offline, its caches under `cache_dir`."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(cache_dir),
        "CGO_ENABLED": "0",
        "GOOS": "linux",
        "GOPROXY": "off",
        "GOTOOLCHAIN": "local",
        "GOCACHE": str(cache_dir / "go-build"),
        "GOPATH": str(cache_dir / "gopath"),
    }


def _go(args: list[str], cache_dir: Path, go_dir: Path = GO_DIR) -> str:
    if shutil.which(GO) is None:
        raise BuildError("the Go toolchain is not installed (Debian's golang-go; `make setup` "
                         "installs it): sandlot's guest agent and init are built with it")
    proc = subprocess.run([GO, *args], cwd=go_dir, env=go_env(cache_dir),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"go {args[0]} failed: {(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def build_guest(cache_dir: Path) -> dict[str, Path]:
    """Build (or reuse) the guest binaries; returns guest path -> host file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    version = _go(["version"], cache_dir).strip()
    out = cache_dir / _sources_digest(version)
    files = {guest: out / Path(guest).name for guest in BINARIES}
    if all(f.is_file() for f in files.values()):
        return files
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".build-"))
    try:
        for guest, package in BINARIES.items():
            _go(["build", *BUILD_FLAGS, "-o", str(tmp / Path(guest).name), f"./{package}"],
                cache_dir)
        tmp.chmod(0o755)  # mkdtemp's 0700: the binaries are for anyone to read
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def build_jail_helper(cache_dir: Path) -> Path:
    """Build (or reuse) the host's `sandlot-jail`; returns its path. BuildError without Go."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    version = _go(["version"], cache_dir, HOST_GO_DIR).strip()
    out = cache_dir / f"host-{_sources_digest(version, HOST_GO_DIR)}"
    path = out / JAIL_HELPER
    if path.is_file():
        return path
    out.mkdir(mode=0o755, exist_ok=True)
    tmp = out / f".{JAIL_HELPER}.{os.getpid()}.tmp"
    try:
        _go(["build", *BUILD_FLAGS, "-o", str(tmp), "./jail"], cache_dir, HOST_GO_DIR)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # concurrent builders write the same bytes
    finally:
        tmp.unlink(missing_ok=True)
    return path


def hash_input(files: dict[str, Path]) -> bytes:
    """What a template build's hash takes from the guest binaries: their paths and bytes."""
    return b"".join(guest.encode() + b"\0" + files[guest].read_bytes()
                    for guest in sorted(files))
