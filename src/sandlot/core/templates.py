"""Templates: build a guest image from a spec, boot it once, snapshot it. Creating a sandbox from
a template is then a restore of that snapshot, never a boot.

Layout under the images dir::

    kernel/<version>/          unpacked Debian cloud kernel (shared by builds)
    builds/<hash>/             vmlinuz, initramfs.gz, rootfs.ext4, spec.json, store/ (snapshot)
    templates/<name>.json      TemplateInfo: name -> build hash
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from pathlib import Path

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sandlot import filelock
from sandlot.core.config import Settings
from sandlot.core.models import TemplateInfo, now
from sandlot.core.sources import HotCache, Source
from sandlot.core.store import MetadataStore
from sandlot.errors import BuildError, InvalidArgumentError, NotFoundError
from sandlot.guest.client import AgentClient
from sandlot.images import initramfs as initramfs_mod
from sandlot.images.initramfs import build_initramfs
from sandlot.images.kernel import ensure_kernel
from sandlot.images.rootfs import build_rootfs, guest_sources_hash_input
from sandlot.images.spec import NAME_RE, TemplateSpec, base_spec
from sandlot.storage.blobs import BlobStore
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.disk import create_overlay, flatten_onto
from sandlot.vmm.machine import DEVICE_MODEL, Machine, MachineSpec

BOOT_TIMEOUT = 180.0


class TemplateStore:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.images
        self.builds = self.root / "builds"
        self.index = self.root / "templates"

    def get(self, name: str) -> TemplateInfo:
        if not NAME_RE.match(name or ""):
            raise NotFoundError(f"template {name!r} not found")
        path = self.index / f"{name}.json"
        try:
            return TemplateInfo.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"template {name!r} not found; build it with "
                                f"`sandlot template build {name}`") from None

    def list(self) -> list[TemplateInfo]:
        if not self.index.exists():
            return []
        return [TemplateInfo.model_validate_json(p.read_text())
                for p in sorted(self.index.glob("*.json"))]

    def remove(self, name: str) -> None:
        self.get(name)
        (self.index / f"{name}.json").unlink()

    def build_dir(self, info: TemplateInfo) -> Path:
        return self.builds / info.hash

    def source(self, name: str) -> Source:
        info = self.get(name)
        build = self.build_dir(info)
        return Source(
            key=f"tpl-{info.hash}", build=build, store=BlobStore(build / "store"),
            blob_key="snapshot", memory_mb=info.memory_mb, cpus=info.cpus, env=dict(info.env),
            template=info.name, workdir=info.workdir, device_model=info.device_model,
        )



def resolve_spec(spec_or_name: str) -> TemplateSpec:
    path = Path(spec_or_name)
    if spec_or_name.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise InvalidArgumentError(f"template spec {spec_or_name} not found")
        return TemplateSpec.load(path)
    if spec_or_name == "base":
        return base_spec()
    raise InvalidArgumentError(
        f"unknown template {spec_or_name!r}: give 'base' or the path of a .toml spec")


def _content_hash(spec: TemplateSpec) -> str:
    extra = guest_sources_hash_input() + initramfs_mod.INIT_SCRIPT.encode()
    extra += f"device-model={DEVICE_MODEL}".encode()  # includes the kernel command line
    extra += " ".join(initramfs_mod.MODULES).encode()
    return spec.content_hash(extra=hashlib.sha256(extra).digest())


async def cold_boot(build: Path, run_dir: Path, memory_mb: int, cpus: int, accel: str,
                    disk: Path) -> tuple[Machine, AgentClient, float]:
    """Boot a build from scratch (slow under TCG); returns machine, agent, boot time in ms."""
    t0 = time.monotonic()
    await create_overlay(disk, build / "rootfs.ext4", "raw", (build / "rootfs.ext4").stat().st_size)
    spec = MachineSpec(run_dir=run_dir, kernel=build / "vmlinuz", initrd=build / "initramfs.gz",
                       disk=disk, memory_mb=memory_mb, cpus=cpus, accel=accel)
    machine = await Machine.launch(spec)
    try:
        agent = await AgentClient.connect(str(spec.agent_socket), timeout=BOOT_TIMEOUT)
    except BaseException:
        console = run_dir / "console.log"
        tail = console.read_text(errors="replace")[-1500:] if console.exists() else ""
        await machine.kill()
        raise BuildError(f"guest did not come up: {tail}") from None
    return machine, agent, (time.monotonic() - t0) * 1000


async def snapshot_build(settings: Settings, build: Path, spec: TemplateSpec) -> float:
    """Boot the build once and store its snapshot (ram, devstate, flattened disk)."""
    run_dir = settings.run_root / f"tb-{build.name[:8]}"
    shutil.rmtree(run_dir, ignore_errors=True)
    work = build / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    machine, agent, boot_ms = await cold_boot(build, run_dir, spec.memory_mb, spec.cpus,
                                              settings.accel, work / "boot.qcow2")
    try:
        await agent.configure(env=dict(spec.env), generation="template", cpus=spec.cpus)
        # Let boot-time work settle so the snapshot is of an idle guest.
        # Freed pages are zeroed (init_on_free=1), so dropping caches leaves them out of the
        # snapshot: less RAM to store, map and migrate for everything derived from it.
        await run_to_exit(agent, "sync; echo 3 > /proc/sys/vm/drop_caches")
        await warm_up(agent)
        await asyncio.sleep(0.5)
        result = await vmm_snapshot.capture(machine, work / "snap", work / "after.qcow2",
                                            settings.run_root / f"th-{build.name[:8]}", "ov1",
                                            live=False)
    finally:
        await agent.close()
        await machine.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    await vmm_snapshot.punch_zero_pages(result.ram)
    disk = work / "snap" / "disk.qcow2"
    await flatten_onto(result.disk, disk, build / "rootfs.ext4", "raw")
    store = BlobStore(build / "store")
    await asyncio.to_thread(store.put, "snapshot", {
        "ram": result.ram, "devstate": result.devstate, "disk": disk,
    }, {"memory_mb": spec.memory_mb, "cpus": spec.cpus})
    shutil.rmtree(work, ignore_errors=True)
    return boot_ms


async def run_to_exit(agent: AgentClient, cmd: str, **fields) -> None:
    async for header, _ in agent.stream("exec", cmd=cmd, **fields):
        if header.get("event") == "exit" and header.get("exit_code"):
            raise BuildError(f"template warm-up command failed: {cmd}")


async def warm_up(agent: AgentClient) -> None:
    """Exercise the agent before the snapshot: its worker threads, the modules it imports
    lazily and the files a first command reads are then already there in every restore."""
    await asyncio.gather(*(run_to_exit(agent, "true") for _ in range(4)))
    await run_to_exit(agent, "id >/dev/null; ls / >/dev/null", user="user")
    await agent.upload("/tmp/.warm", _one_chunk(b"warm"))
    async for _ in agent.stream("read", path="/tmp/.warm"):
        pass
    for op in ("stat", "exists", "remove"):
        await agent.request(op, path="/tmp/.warm")
    await agent.request("list", path="/tmp")
    await agent.request("configure", freeze=True)


async def _one_chunk(data: bytes):
    yield data


def build_template(spec_or_name: str, data_dir: Path | None = None, force: bool = False,
                   settings: Settings | None = None, quiet: bool = False) -> TemplateInfo:
    """Build (or reuse, by content hash) a template and point its name at the build."""
    settings = settings or Settings.from_env(data_dir)
    settings.ensure()
    spec = resolve_spec(spec_or_name)
    store = TemplateStore(settings)
    store.root.mkdir(parents=True, exist_ok=True)
    # One build at a time per images dir, across processes.
    with filelock.exclusive(store.root / ".build.lock"), \
            Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                     disable=quiet, transient=False) as progress:
        step = progress.add_task(f"template {spec.name}: kernel", total=None)
        kernel = ensure_kernel(store.root / "kernel")
        digest = _content_hash(spec) + "-" + hashlib.sha256(kernel.version.encode()).hexdigest()[:4]
        build = store.builds / digest
        done = build / "template.json"
        if done.exists() and not force:
            info = TemplateInfo.model_validate_json(done.read_text())
            info.name = spec.name
            progress.update(step, description=f"template {spec.name}: up to date ({digest})")
        else:
            shutil.rmtree(build, ignore_errors=True)
            build.mkdir(parents=True)
            try:
                shutil.copy2(kernel.vmlinuz, build / "vmlinuz")
                progress.update(step, description=f"template {spec.name}: initramfs")
                build_initramfs(kernel, build / "initramfs.gz")
                progress.update(step, description=f"template {spec.name}: root filesystem "
                                f"({len(spec.packages)} extra packages)")
                build_rootfs(spec, build / "rootfs.ext4", kernel)
                progress.update(step, description=f"template {spec.name}: boot and snapshot")
                boot_ms = asyncio.run(snapshot_build(settings, build, spec))
            except BaseException:
                shutil.rmtree(build, ignore_errors=True)
                raise
            info = TemplateInfo(name=spec.name, hash=digest, memory_mb=spec.memory_mb,
                                cpus=spec.cpus, env=spec.env, workdir=spec.workdir,
                                built_at=now(), kernel=kernel.version, boot_ms=boot_ms,
                                device_model=DEVICE_MODEL)
            (build / "spec.json").write_text(spec.model_dump_json(indent=2))
            done.write_text(info.model_dump_json(indent=2))
            progress.update(step, description=f"template {spec.name}: built ({digest}, "
                            f"boot {boot_ms / 1000:.1f}s)")
        store.index.mkdir(parents=True, exist_ok=True)
        tmp = store.index / f"{spec.name}.json.tmp"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(store.index / f"{spec.name}.json")
    return info


def collect_garbage(data_dir: Path | None = None, dry_run: bool = False) -> list[str]:
    """Remove the template builds nothing needs any more; returns their names.

    A build is kept while a template points at it, or a snapshot (creating, uploading or ready)
    or a running sandbox of `data_dir` was made from it (their restores map its kernel,
    initramfs and root filesystem). An images dir shared by several data dirs must be collected
    from the one whose snapshots matter: the others' are not looked at.
    """
    settings = Settings.from_env(data_dir)
    store = TemplateStore(settings)
    if not store.builds.exists():
        return []
    with filelock.exclusive(store.root / ".build.lock"):  # never a build in progress
        keep = {t.hash for t in store.list()}
        if settings.db_path.exists():
            db = MetadataStore(settings.db_path)
            try:
                keep |= {d.get("base") for d in db.snapshots(("creating", "uploading", "ready"))}
                keep |= {d.get("base") for d in db.sandboxes(("starting", "running"))}
            finally:
                db.close()
        unused = sorted(b.name for b in store.builds.iterdir()
                        if b.is_dir() and b.name not in keep)
        if not dry_run:
            for name in unused:
                shutil.rmtree(store.builds / name, ignore_errors=True)
    return unused


def list_templates(data_dir: Path | None = None) -> list[TemplateInfo]:
    return TemplateStore(Settings.from_env(data_dir)).list()


def remove_template(name: str, data_dir: Path | None = None) -> None:
    TemplateStore(Settings.from_env(data_dir)).remove(name)


__all__ = ["TemplateStore", "build_template", "list_templates", "remove_template", "HotCache",
           "cold_boot", "collect_garbage"]
