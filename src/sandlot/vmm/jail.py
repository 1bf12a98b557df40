"""Confinement of a QEMU process: it runs under a user id of its own, with no capabilities,
under QEMU's seccomp filter, inside its sandbox's network namespace, and in a cgroup that
limits its memory, processes and CPU.

The parent does what needs privilege: it creates the files QEMU writes and gives them to the
VM's uid, creates the tap (owned by that uid, so QEMU opens it unprivileged) and the cgroup.
QEMU is then started through `sandlot-jail` (a static Go program, `vmm/go/jail`, built and
cached like the guest's: images/guest.py), which in one process joins the cgroup, enters the
sandbox's network namespace, makes a private mount namespace showing only the VM's paths
(`View`), drops every capability, takes the VM's uid and groups with no_new_privs, and execs
QEMU with the environment it was given:

    sandlot-jail --cgroup ... --netns ... --fstab ... --uid ... -- qemu-system-x86_64 ...
        -sandbox on,...

Without Go on the host the same is a chain of execs of shell tools (~8 ms more CPU and
~15-20 ms more per QEMU start here):

    sh (joins the cgroup) -> nsenter --net (the sandbox's namespace) -> unshare --mount -> sh
    (mount -a, pivot_root) -> setpriv (uid, groups, no capabilities, no_new_privs) -> qemu

so QEMU is never privileged (no ``-runas``: QEMU's ``elevateprivileges=deny`` forbids the
setuid that needs). Its seccomp filter also denies spawning processes, so it must not use
``exec:`` migrations (sandlot uses unix sockets and files).

Each VM gets its own uid from a host-wide range, so one compromised QEMU cannot signal, trace
or read another's memory, sockets or disks. What every VM must read (kernel, initramfs, the
template root filesystem, an image's disk layer) is world- or group-readable; an image's RAM
file is mapped copy-on-write, but QEMU 7.2 opens it read-write (its ``readonly`` option maps
guest RAM read-only), so RAM files are writable by the group of all VMs (`VM_GID`), and by no
one else: a QEMU escape could alter an image other sandboxes map. QEMU 8.2's
``readonly=on,rom=off`` (a read-only file mapped copy-on-write) closes that; docs/security.md.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sandlot.errors import VmmError

log = logging.getLogger(__name__)

UID_BASE = 1_900_000_000  # VM uids: UID_BASE + slot, host-wide, no passwd entries
UID_SLOTS = 100_000
VM_GID = UID_BASE - 1  # every VM's group: may open the hot cache's RAM files
UID_DIR = Path("/run/sandlot-uids")  # one file per uid in use: "<instance> <vm id>"
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
CGROUP_ROOT = Path("/sys/fs/cgroup")
QEMU_OVERHEAD_MB = 256  # QEMU itself beside guest RAM: TCG's code cache, device buffers
PIDS_MAX = 256  # QEMU's threads: vCPUs, the main loop, its I/O thread pool (64 at most)
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Limits:
    """What a VM's cgroup allows."""

    memory_bytes: int
    pids: int = PIDS_MAX
    cpus: float = 1.0  # cores of CPU time per period
    weight: int = 100  # CPU and IO weight relative to other sandboxes (v2 scale, 1-10000)

    @classmethod
    def for_vm(cls, memory_mb: int, cpus: int) -> Limits:
        return cls(memory_bytes=memory_limit_mb(memory_mb) << 20, cpus=float(cpus),
                   weight=100 * cpus)


def memory_limit_mb(memory_mb: int) -> int:
    """A VM's memory cgroup limit: its RAM twice, and QEMU's own. A restored VM's RAM is a
    private mapping of its image on tmpfs: a page the guest touches where the image has a
    hole (memory the template never used) is first allocated in the image file (tmpfs, not
    reclaimable, shared by every VM of that image but charged to the first to touch it), then
    copied to the VM's own page. A guest using all its RAM measured 306 MiB of the first and
    344 MiB of the second for 300 MiB touched; with RAM + 256 MiB a fork bomb got QEMU
    OOM-killed by its own cgroup."""
    return 2 * memory_mb + QEMU_OVERHEAD_MB


@dataclass(frozen=True)
class Jail:
    """How one QEMU process is confined; saved with the VM so a restarted server frees it."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    cgroups: tuple[str, ...]  # cgroup directories it joins (one per v1 controller, or one)
    netns: str | None = None
    fstab: str | None = None  # its private mount namespace's mounts (`View.write`)
    helper: str | None = None  # sandlot-jail; None: the chain of shell tools

    def prefix(self) -> list[str]:
        """What confines the command it is put in front of: sandlot-jail, or a chain of
        execs of shell tools that does the same."""
        if self.helper:
            cmd = [self.helper]
            for c in self.cgroups:
                cmd += ["--cgroup", c]
            if self.netns:
                cmd += ["--netns", self.netns]
            if self.fstab:
                cmd += ["--fstab", self.fstab, "--root", str(ROOT_SKELETON)]
            return cmd + ["--uid", str(self.uid), "--gid", str(self.gid),
                          "--groups", ",".join(str(g) for g in self.groups), "--"]
        chain: list[str] = []
        if self.cgroups:
            procs = " ".join(f"{c}/cgroup.procs" for c in self.cgroups)
            chain += ["/bin/sh", "-c",
                      f'for p in {procs}; do echo $$ > "$p" || exit 125; done; exec "$@"',
                      "sandlot-jail"]
        if self.netns:
            chain += ["nsenter", f"--net=/run/netns/{self.netns}", "--"]
        if self.fstab:
            # A mount namespace of its own whose root shows only what it needs (View).
            chain += ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                      'set -e; mount -a --fstab "$0"; cd "$1"; pivot_root . .old; '
                      'umount -l /.old; cd /; shift; exec "$@"', self.fstab, str(ROOT_SKELETON)]
        chain += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                  "--groups=" + ",".join(str(g) for g in self.groups),
                  "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return chain

    def own(self, *paths: Path) -> None:
        """Give files and directories QEMU must write to the VM's uid (mode 0700/0600)."""
        for path in paths:
            os.chown(path, self.uid, self.gid)
            os.chmod(path, 0o700 if path.is_dir() else 0o600)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Jail:
        return cls(uid=int(data["uid"]), gid=int(data["gid"]),
                   groups=tuple(int(g) for g in data["groups"]),
                   cgroups=tuple(data.get("cgroups", ())), netns=data.get("netns"),
                   fstab=data.get("fstab"), helper=data.get("helper"))


ROOT_SKELETON = Path("/run/sandlot-root")  # the root a confined QEMU sees (empty dirs)
FSTAB_DIR = Path("/run/sandlot-mounts")  # each VM's mounts, root's only
_DEVICES = ("null", "zero", "urandom", "random")


def _skeleton(kvm: bool) -> None:
    """The shared, empty root every VM's namespace mounts what it needs on (idempotent)."""
    for d in ("usr", "etc", "dev", "proc", ".old"):
        (ROOT_SKELETON / d).mkdir(parents=True, exist_ok=True)
    os.chmod(ROOT_SKELETON, 0o755)
    FSTAB_DIR.mkdir(mode=0o700, exist_ok=True)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host, here = Path("/") / name, ROOT_SKELETON / name
        if host.is_symlink() and not here.is_symlink():  # merged /usr (Debian 12)
            here.symlink_to(os.readlink(host))
        elif host.is_dir() and not host.is_symlink():
            here.mkdir(exist_ok=True)
    for f in ["etc/ld.so.cache", *(f"dev/{d}" for d in _DEVICES + (("kvm",) if kvm else ()))]:
        (ROOT_SKELETON / f).touch(exist_ok=True)


@dataclass(frozen=True)
class View:
    """What a confined QEMU's mount namespace shows: the system's programs and libraries
    read-only, a few devices, its own /proc entries, and the paths of this VM (`rw`: its run
    and disk dirs, its image's files; `ro`: its kernel, initramfs and root filesystem)."""

    rw: tuple[Path, ...]
    ro: tuple[Path, ...]
    kvm: bool = False

    def write(self, uid: int) -> str:
        """Write the VM's fstab (and the mount points it needs); returns its path."""
        lines = [f"{ROOT_SKELETON} {ROOT_SKELETON} none bind 0 0",
                 f"/usr {ROOT_SKELETON}/usr none bind,ro 0 0"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_dir() and not host.is_symlink():
                lines.append(f"{host} {ROOT_SKELETON}{host} none bind,ro 0 0")
        if Path("/etc/ld.so.cache").exists():
            lines.append(f"/etc/ld.so.cache {ROOT_SKELETON}/etc/ld.so.cache none bind,ro 0 0")
        for d in _DEVICES + (("kvm",) if self.kvm else ()):
            lines.append(f"/dev/{d} {ROOT_SKELETON}/dev/{d} none bind 0 0")
        for paths, opts in ((self.ro, "bind,ro"), (self.rw, "bind")):
            for path in paths:
                (ROOT_SKELETON / path.relative_to("/")).mkdir(parents=True, exist_ok=True)
                lines.append(f"{path} {ROOT_SKELETON}{path} none {opts} 0 0")
        lines.append(f"proc {ROOT_SKELETON}/proc proc hidepid=invisible,nosuid,nodev,noexec 0 0")
        for line in lines:
            if any(c.isspace() for c in line.split(" ")[0] + line.split(" ")[1]):
                raise VmmError(f"a VM path with white space cannot be mounted: {line}")
        fstab = FSTAB_DIR / f"{uid}.fstab"
        fstab.write_text("\n".join(lines) + "\n")
        return str(fstab)


def share_with_vms(entry: Path) -> None:
    """An image's files in the hot cache: readable by every VM, RAM files also writable (QEMU
    7.2 opens them read-write to map them copy-on-write); nothing for other users."""
    os.chown(entry, 0, VM_GID)
    os.chmod(entry, 0o750)
    for path in entry.iterdir():
        if path.is_file():
            os.chown(path, 0, VM_GID)
            os.chmod(path, 0o660 if path.name.startswith("ram") else 0o640)


def open_to_vms(path: Path) -> None:
    """A directory on the way to images (the hot cache's root): VMs may pass through it."""
    os.chown(path, 0, VM_GID)
    os.chmod(path, 0o750)


def ensure_traversable(path: Path) -> None:
    """VMs reach their files by path: let any user pass through (not list) root's
    directories on the way to `path` (e.g. a 0700 temporary directory)."""
    for d in [path, *path.parents]:
        try:
            st = d.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == 0 and not st.st_mode & 0o001:
            os.chmod(d, (st.st_mode & 0o7777) | 0o001)
            log.info("made %s traversable for VM users", d)


def cgroup_version() -> int:
    """2 (unified), 1 (legacy controllers mounted) or 0 (none usable)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        return 1
    return 0


def _write(path: Path, value: str, required: bool = True) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        if required:
            raise VmmError(f"cgroup: writing {value!r} to {path}: {e.strerror or e}") from e


class Jails:
    """Allocates VM uids and cgroups for one server instance (several may share a host)."""

    def __init__(self, instance: str, *, kvm: bool = False, enabled: bool = True,
                 helper: Path | None = None) -> None:
        self.instance = instance
        self.helper = helper  # sandlot-jail, if built
        self.enabled = enabled and os.geteuid() == 0
        self.version = cgroup_version() if self.enabled else 0
        self.groups: tuple[int, ...] = (VM_GID,)
        if kvm:
            with contextlib.suppress(KeyError):
                self.groups += (grp.getgrnam("kvm").gr_gid,)
        self._base = f"sandlot/{instance}"
        self.kvm = kvm
        if self.enabled:
            _skeleton(kvm)

    # ---- uids --------------------------------------------------------------------------

    def _take_uid(self, vm_id: str) -> int:
        UID_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        start = random.randrange(UID_SLOTS)
        for i in range(UID_SLOTS):
            uid = UID_BASE + (start + i) % UID_SLOTS
            try:
                fd = os.open(UID_DIR / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.instance} {vm_id}\n")
            return uid
        raise VmmError("no VM user id left")

    # ---- cgroups -----------------------------------------------------------------------

    def _cgroup_dirs(self, vm_id: str) -> list[Path]:
        if self.version == 2:
            return [CGROUP_ROOT / self._base / vm_id]
        if self.version == 1:
            return [CGROUP_ROOT / c / self._base / vm_id for c in ("memory", "pids", "cpu")
                    if (CGROUP_ROOT / c).is_dir()]
        return []

    def _enable_v2_controllers(self) -> None:
        """Controllers must be enabled in every ancestor's subtree_control (v2)."""
        path = CGROUP_ROOT
        for part in self._base.split("/"):
            _write(path / "cgroup.subtree_control", "+memory +pids +cpu +io", required=False)
            path = path / part
            path.mkdir(exist_ok=True)
        _write(path / "cgroup.subtree_control", "+memory +pids +cpu +io", required=False)

    def _make_cgroups(self, vm_id: str, limits: Limits) -> list[Path]:
        dirs = self._cgroup_dirs(vm_id)
        if self.version == 2:
            self._enable_v2_controllers()
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        quota = int(limits.cpus * CPU_PERIOD_US)
        if self.version == 2:
            (d,) = dirs
            _write(d / "memory.max", str(limits.memory_bytes))
            _write(d / "memory.swap.max", "0", required=False)
            _write(d / "pids.max", str(limits.pids))
            _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            _write(d / "cpu.weight", str(limits.weight), required=False)
            _write(d / "io.weight", f"default {limits.weight}", required=False)
        elif self.version == 1:
            for d in dirs:
                controller = d.relative_to(CGROUP_ROOT).parts[0]
                if controller == "memory":
                    _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
                    _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_bytes),
                           required=False)
                elif controller == "pids":
                    _write(d / "pids.max", str(limits.pids))
                elif controller == "cpu":
                    _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    _write(d / "cpu.cfs_quota_us", str(quota))
                    _write(d / "cpu.shares", str(1024 * limits.weight // 100), required=False)
        return dirs

    # ---- a VM's jail -------------------------------------------------------------------

    def make(self, vm_id: str, limits: Limits, rw: tuple[Path, ...] = (),
             ro: tuple[Path, ...] = ()) -> Jail | None:
        """A uid, cgroups and a view of the filesystem (`rw`, `ro`: the paths it needs) for
        VM `vm_id`; None when confinement is off."""
        if not self.enabled:
            return None
        uid = self._take_uid(vm_id)
        try:
            dirs = self._make_cgroups(vm_id, limits)
            fstab = View(rw=rw, ro=ro, kvm=self.kvm).write(uid)
        except BaseException:
            (UID_DIR / str(uid)).unlink(missing_ok=True)
            raise
        return Jail(uid=uid, gid=uid, groups=self.groups, cgroups=tuple(str(d) for d in dirs),
                    fstab=fstab, helper=str(self.helper) if self.helper else None)

    def release(self, jail: Jail | None) -> None:
        """After the VM's QEMU has exited: its cgroups and its uid go."""
        if jail is None:
            return
        for d in jail.cgroups:
            _remove_cgroup(Path(d))
        if jail.fstab:
            Path(jail.fstab).unlink(missing_ok=True)
        (UID_DIR / str(jail.uid)).unlink(missing_ok=True)

    def recover(self, keep: set[str]) -> None:
        """At start: free the uids and cgroups this instance's dead VMs left behind."""
        if not self.enabled:
            return
        for path in UID_DIR.iterdir() if UID_DIR.is_dir() else ():
            try:
                instance, vm_id = path.read_text().split()[:2]
            except (OSError, ValueError):
                continue
            if instance == self.instance and vm_id not in keep:
                (FSTAB_DIR / f"{path.name}.fstab").unlink(missing_ok=True)
                path.unlink(missing_ok=True)
        for d in self._instance_cgroup_roots():
            for child in d.iterdir() if d.is_dir() else ():
                if child.is_dir() and child.name not in keep:
                    _remove_cgroup(child)
            if not keep and d.is_dir():
                _remove_cgroup(d)

    def _instance_cgroup_roots(self) -> list[Path]:
        if self.version == 2:
            return [CGROUP_ROOT / self._base]
        if self.version == 1:
            return [CGROUP_ROOT / c / self._base for c in ("memory", "pids", "cpu")]
        return []

    def limits_of(self, jail: Jail) -> dict[str, str]:
        """The limits the kernel holds for a jail (for /health and tests)."""
        out = {}
        for d in map(Path, jail.cgroups):
            for name in ("memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max",
                         "cpu.cfs_quota_us"):
                with contextlib.suppress(OSError):
                    out[name] = (d / name).read_text().strip()
        return out


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup once its processes are gone (it empties a moment after the exit)."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                log.warning("cgroup %s not removed: %s", path, e)
                return
            time.sleep(0.02)
    log.warning("cgroup %s still busy; left behind", path)


def has_tools() -> bool:
    return all(shutil.which(t) for t in ("setpriv", "nsenter"))
