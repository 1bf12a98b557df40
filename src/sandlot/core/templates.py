"""Templates: build a guest image from a spec, boot it once, snapshot it. Creating a sandbox from
a template is then a restore of that snapshot, never a boot.

Layout under the images dir::

    kernel/<version>/          unpacked Debian cloud kernel (shared by builds)
    builds/<hash>/             vmlinuz, initramfs.gz, rootfs.ext4, spec.json, store/ (snapshot)
    templates/<name>.json      TemplateInfo: name -> build hash
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sandlot import filelock
from sandlot.config import Settings
from sandlot.core.db import MetadataStore, run_sync, with_store
from sandlot.core.models import TemplateInfo, now
from sandlot.core.sources import Source
from sandlot.core.tenancy import SYSTEM, Principal
from sandlot.errors import (
    ImageError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
)
from sandlot.images import dockerfile as dockerfile_mod
from sandlot.images import initramfs as initramfs_mod
from sandlot.images import oci
from sandlot.images.guest import build_guest
from sandlot.images.guest import hash_input as guest_hash_input
from sandlot.images.imagefs import build_image_rootfs
from sandlot.images.initramfs import build_initramfs
from sandlot.images.kernel import Kernel, ensure_kernel
from sandlot.images.rootfs import build_rootfs
from sandlot.images.spec import NAME_RE, TemplateSpec, base_spec
from sandlot.runtime.base import Image, MachineDescription, MachinePlan, Runtime
from sandlot.vmm.machine import DEVICE_MODEL
from sandlot.vmm.qemu import qemu_info

log = logging.getLogger(__name__)
DEFAULT_TAG = "default"  # E2B's tag of a template's own build
IMAGE_TEMPLATE_PREFIX = "image-"  # the templates creates from an OCI image make
IMAGE_BUILDER_VERSION = "1"  # bump when a build from an image changes in a way its digest
# does not show


class TemplateStore:
    """Template names -> builds: this host's index (the builds it made or fetched), and the
    store's, for templates another host built. Pass the runtime to reach the store, and the
    metadata store (`db`) for the templates built through the API: the deployment's record
    of those wins over this host's index, so a template rebuilt or deleted on another host
    is never restored from what this host remembers of it."""

    def __init__(self, settings: Settings, runtime: Runtime | None = None,
                 db: MetadataStore | None = None) -> None:
        self.settings = settings
        self.runtime = runtime
        self.db = db
        self.root = settings.images
        self.builds = self.root / "builds"
        self.index = self.root / "templates"
        self._image_builds: dict[str, asyncio.Task] = {}
        self._image_names: dict[str, str] = {}  # reference -> its template, as last resolved

    def get(self, name: str) -> TemplateInfo:
        if not NAME_RE.fullmatch(name or ""):
            raise NotFoundError(f"template {name[:64]!r} not found")
        path = self.index / f"{name}.json"
        try:
            return TemplateInfo.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"template {name!r} not found; build it with "
                                f"`sandlot template build {name}`") from None

    def list(self, who: Principal = SYSTEM) -> list[TemplateInfo]:
        """This host's templates `who` may use (every one for an admin and for core)."""
        if not self.index.exists():
            return []
        infos = [TemplateInfo.model_validate_json(p.read_text())
                 for p in sorted(self.index.glob("*.json"))]
        return [i for i in infos if visible(i, who)]

    def remove(self, name: str) -> None:
        self.get(name)
        (self.index / f"{name}.json").unlink()

    async def delete(self, name: str) -> None:
        """Remove a template built through the API, here and for every host."""
        with contextlib.suppress(FileNotFoundError):
            (self.index / f"{name}.json").unlink()
        if self.db is not None:
            await self.db.put_template(name, None)

    async def info(self, name: str, who: Principal = SYSTEM) -> TemplateInfo:
        """A template by name that `who` may use: this host's, else the store's (then
        remembered here)."""
        info = await self.current(name)
        if not visible(info, who):
            raise NotFoundError(f"template {name!r} not found")
        return info

    async def current(self, name: str) -> TemplateInfo:
        """A template as the deployment has it now, whoever may use it: the metadata
        store's record of a template built through the API (remembered here when it differs:
        a rebuild on another host), else this host's index, else the store's. `name:tag`
        names a tagged build (E2B's tags; `name:default` is `name`)."""
        base, _, tag = (name or "").partition(":")
        if not NAME_RE.fullmatch(base) or (tag and not NAME_RE.fullmatch(tag)):
            raise NotFoundError(f"template {name[:64]!r} not found")  # never looked up
        name = base if tag == DEFAULT_TAG else name
        if tag and tag != DEFAULT_TAG:
            row = await self.db.get_template(name) if self.db is not None else None
            if row is None or row.doc is None:
                raise NotFoundError(f"template {base!r} has no build tagged {tag!r}")
            return TemplateInfo.model_validate(row.doc)
        row = await self.db.get_template(name) if self.db is not None else None
        if row is not None:
            try:
                known: TemplateInfo | None = self.get(name)
            except (NotFoundError, ValueError):
                known = None
            if row.doc is None:  # deleted (on this host or another)
                if known is not None and known.owner is None and not known.snapshot_id:
                    return known  # the operator's, built here since (`sandlot template`)
                with contextlib.suppress(FileNotFoundError):
                    (self.index / f"{name}.json").unlink()
                raise NotFoundError(f"template {name!r} not found")
            info = TemplateInfo.model_validate(row.doc)
            if known != info:
                self._remember(info)
            return info
        try:
            return self.get(name)
        except NotFoundError:
            if self.runtime is None:
                raise
        try:
            info = TemplateInfo.model_validate(await self.runtime.template_info(name))
        except NotFoundError:
            raise NotFoundError(f"template {name!r} not found here or in the store; build it "
                                f"with `sandlot template build {name}`") from None
        self._remember(info)
        return info

    async def tagged(self, name: str) -> dict[str, TemplateInfo]:
        """A template's tags (E2B's) and the builds they name: `default` is the template's
        own build."""
        tags = {}
        with contextlib.suppress(NotFoundError):
            tags[DEFAULT_TAG] = await self.current(name)
        for row in await self.db.templates() if self.db is not None else []:
            base, _, tag = row.name.partition(":")
            if base == name and tag and row.doc is not None:
                tags[tag] = TemplateInfo.model_validate(row.doc)
        return tags

    async def put_tag(self, name: str, tag: str, info: TemplateInfo | None) -> None:
        """Point tag `tag` of template `name` at a build (None: remove the tag)."""
        await self.db.put_template(f"{name}:{tag}", None if info is None
                                   else info.model_dump(mode="json"))

    async def listing(self, who: Principal = SYSTEM) -> list[TemplateInfo]:
        """The templates `who` may use: this host's, and those built through the API on any
        host of the deployment (as they are now)."""
        infos = {i.name: i for i in self.list(SYSTEM)}
        for row in await self.db.templates() if self.db is not None else []:
            if ":" in row.name:
                continue  # a tag
            if row.doc is None:
                infos.pop(row.name, None)
            else:
                infos[row.name] = TemplateInfo.model_validate(row.doc)
        return [infos[n] for n in sorted(infos) if visible(infos[n], who)]

    def _remember(self, info: TemplateInfo) -> None:
        self.index.mkdir(parents=True, exist_ok=True)
        tmp = self.index / f"{info.name}.json.{secrets.token_hex(4)}.tmp"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(self.index / f"{info.name}.json")

    async def image_source(self, reference: str) -> Source:
        """What a create from an OCI image starts from: the image's template, built on first
        use (by digest: the reference is resolved each time, unless pinned). Builds run in a
        thread (pull, unpack, mkfs) and boot on this server's runtime; concurrent creates of
        one image share one build."""
        access = registry_access(self.settings)
        ref = oci.parse_reference(reference)
        try:
            pinned = await asyncio.to_thread(oci.resolve, ref, access)
        except ImageError as e:
            # A registry that does not answer: a tag this server built before still creates
            # (from what it named then). A missing image or a bad reference is still an error.
            known = self._image_names.get(ref.text)
            if known is None:
                raise
            log.warning("image %s: %s; using the template it named before (%s)", reference,
                        e.message, known)
            return await self.source(known, SYSTEM)
        name = image_template_name(pinned)
        assert pinned.digest
        try:
            info = await self.info(name)
            if not await asyncio.to_thread(image_template_current, info, pinned.digest,
                                           self.root):
                raise NotFoundError(f"template {name} was built by another sandlot")
            source = await self.source(name, SYSTEM)
        except NotFoundError:
            task = self._image_builds.get(pinned.digest)
            if task is None:
                task = asyncio.create_task(self._build_image(pinned, name, access))
                self._image_builds[pinned.digest] = task
                task.add_done_callback(lambda _: self._image_builds.pop(pinned.digest, None))
            await asyncio.shield(task)
            source = await self.source(name, SYSTEM)
        self._image_names[ref.text] = name
        return source

    async def private_image(self, ref: oci.Reference, access: oci.Access,
                            who: Principal) -> tuple[str, oci.Reference]:
        """The template of an image pulled with a tenant's own registry credentials (in
        `access`, for one build): the registry is asked with them every time (a pinned
        reference too), and the pull and its template are that tenant's alone: never the
        shared `image-<digest>` template, nor a pull another create could find by digest.
        Returns the template's name and the reference pinned."""
        pinned = await asyncio.to_thread(oci.resolve, ref, access, True)
        assert pinned.digest
        key = hashlib.sha256(f"{who.tenant}\0{pinned.digest}".encode()).hexdigest()[:16]
        name = f"{IMAGE_TEMPLATE_PREFIX}t{key}"
        with contextlib.suppress(NotFoundError):
            info = await self.info(name)
            if info.owner == who.tenant and await asyncio.to_thread(
                    image_template_current, info, pinned.digest, self.root):
                return name, pinned
        layout = self.root / "oci" / f".private-{secrets.token_hex(8)}"
        try:
            await self._build_image(pinned, name, access, layout)
        finally:
            await asyncio.to_thread(shutil.rmtree, layout, True)
        await self.put(self.get(name).model_copy(update={"owner": who.tenant}))
        return name, pinned

    async def _build_image(self, ref: oci.Reference, name: str, access: oci.Access,
                           layout: Path | None = None) -> None:
        loop = asyncio.get_running_loop()
        runtime = self.runtime
        if runtime is None:
            raise InvalidStateError("this server cannot build templates")

        def on_loop(coro):  # the boot and publish run on this server's runtime
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        await asyncio.to_thread(pull_image_template, ref.pinned, name, settings=self.settings,
                                access=access, quiet=True, runtime=lambda _: runtime,
                                run=on_loop, layout=layout)

    async def source(self, name: str, who: Principal) -> Source:
        """A template `who` may use, as a restore source."""
        info = await self.info(name, who)
        return Source(image=image_of(info), env=dict(info.env), template=info.name,
                      workdir=info.workdir, user=info.user, started_from=info.snapshot_id,
                      owner=info.owner)

    async def put(self, info: TemplateInfo) -> None:
        """Point `info.name` at `info` (a build of this host), here, in the store and, for
        every host of the deployment, in the metadata store."""
        if self.runtime is not None:
            await self.runtime.publish_template(image_of(info), info.model_dump(mode="json"))
        self._remember(info)
        if self.db is not None:
            await self.db.put_template(info.name, info.model_dump(mode="json"))


def registry_access(settings: Settings) -> oci.Access:
    """How this server's image pulls reach registries (its settings)."""
    return oci.Access.of(settings.insecure_registries, None, settings.registry_auth_file,
                         settings.registries)


def visible(info: TemplateInfo, who: Principal) -> bool:
    """Shared templates (the operator's) are every tenant's; a template a tenant built is
    its own; the templates creates from an image make (by digest) are named only by admins
    (a tenant creates from the image reference, which is checked against its registry)."""
    if who.admin:
        return True
    if info.name.startswith(IMAGE_TEMPLATE_PREFIX) and info.image:
        return info.owner == who.tenant  # an image pulled with a tenant's own credentials
    return info.owner is None or info.owner == who.tenant


def image_of(info: TemplateInfo) -> Image:
    """The boot image of a template build (InvalidStateError if it does not say what
    machine it is: an older sandlot built it)."""
    try:
        machine = MachineDescription.from_dict(info.machine)
    except InvalidStateError:
        raise InvalidStateError(f"template {info.name!r} was built by an older sandlot; "
                                f"rebuild it: `sandlot template build {info.name}`") from None
    return Image(key=f"tpl-{info.hash}", build=info.hash, machine=machine)


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


GuestFiles = dict[str, Path]  # guest path -> host file of sandlot's own programs


def _guest_files(images: Path) -> GuestFiles:
    """sandlot's guest programs (static binaries, built once per sources), for every kind of
    build."""
    return build_guest(images / "guest")


def _environment_hash(guest_files: GuestFiles) -> bytes:
    """What every build depends on besides its own input: the guest files, the initramfs,
    the device model and QEMU's machine."""
    extra = guest_hash_input(guest_files) + initramfs_mod.INIT_SCRIPT.encode()
    extra += f"device-model={DEVICE_MODEL}".encode()  # includes the kernel command line
    extra += f"machine={qemu_info().default_q35}".encode()
    extra += " ".join(initramfs_mod.MODULES).encode()
    return hashlib.sha256(extra).digest()


def _content_hash(spec: TemplateSpec, guest_files: GuestFiles | None = None) -> str:
    assert guest_files is not None
    return spec.content_hash(extra=_environment_hash(guest_files))


def _qemu_runtime(settings: Settings) -> Runtime:
    from sandlot.runtime.qemu import QemuRuntime

    return QemuRuntime(settings)


Step = Callable[[str], None]


@contextlib.contextmanager
def _progress(label: str, quiet: bool) -> Iterator[Step]:
    """A spinner with the build's current step (`step("...")`), or log lines when quiet."""
    if quiet:
        yield lambda text: log.info("%s: %s", label, text)
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=False) as progress:
        task = progress.add_task(f"{label}: kernel", total=None)
        yield lambda text: progress.update(task, description=f"{label}: {text}")


@dataclass
class _Recipe:
    """One template build: its name, content hash (before the kernel's part), how to make
    its root filesystem in a build dir, and the machine it boots."""

    name: str
    content: Callable[[GuestFiles], str]
    # (build dir, kernel, guest files, step) -> the TemplateInfo fields it sets
    make_rootfs: Callable[[Path, Kernel, GuestFiles, Step], dict]
    memory_mb: int
    cpus: int
    env: dict[str, str] = field(default_factory=dict)
    record: str = ""  # what the build dir keeps of its input (spec.json)


def build_template(spec_or_name: str, data_dir: Path | None = None, force: bool = False,
                   settings: Settings | None = None, quiet: bool = False,
                   runtime: Callable[[Settings], Runtime] = _qemu_runtime) -> TemplateInfo:
    """Build (or reuse, by content hash) a template and point its name at the build: its root
    filesystem, then one boot and capture of it (the runtime's `boot_image`)."""
    settings = settings or Settings.from_env(data_dir)
    spec = resolve_spec(spec_or_name)

    def make_rootfs(build: Path, kernel: Kernel, guest_files: GuestFiles, step: Step) -> dict:
        step(f"root filesystem ({len(spec.packages)} extra packages)")
        build_rootfs(spec, build / "rootfs.ext4", kernel, guest_files)
        return {"env": spec.env, "workdir": spec.workdir}

    recipe = _Recipe(name=spec.name, content=lambda guest: _content_hash(spec, guest),
                     make_rootfs=make_rootfs,
                     memory_mb=spec.memory_mb, cpus=spec.cpus, env=dict(spec.env),
                     record=spec.model_dump_json(indent=2))
    return _build(recipe, settings, force=force, quiet=quiet, runtime=runtime)


def _build(recipe: _Recipe, settings: Settings, *, force: bool, quiet: bool,
           runtime: Callable[[Settings], Runtime], step: Step | None = None,
           run: Callable[[Coroutine], Any] = asyncio.run) -> TemplateInfo:
    """The one build path of every template: kernel, initramfs, the recipe's root
    filesystem, one boot and capture, publish to the store, point the name at the build.
    Cached by the recipe's hash and the kernel's version. `run` runs the runtime's coroutines
    (by default in a loop of their own; a server passes one that runs them on its loop)."""
    settings.ensure()
    store = TemplateStore(settings)
    store.root.mkdir(parents=True, exist_ok=True)
    label = f"template {recipe.name}"
    # One build at a time per images dir, across processes.
    with filelock.exclusive(store.root / ".build.lock"), \
            (contextlib.nullcontext(step) if step else _progress(label, quiet)) as step:
        step("kernel")
        kernel = ensure_kernel(store.root / "kernel")
        step("guest agent and init")
        guest_files = _guest_files(store.root)
        digest = (recipe.content(guest_files) + "-"
                  + hashlib.sha256(kernel.version.encode()).hexdigest()[:4])
        build = store.builds / digest
        done = build / "template.json"
        if done.exists() and (build / "image").is_dir() and not force:
            info = TemplateInfo.model_validate_json(done.read_text())
            info.name = recipe.name
            step(f"up to date ({digest})")
        else:
            shutil.rmtree(build, ignore_errors=True)
            build.mkdir(parents=True)
            try:
                shutil.copy2(kernel.vmlinuz, build / "vmlinuz")
                step("initramfs")
                build_initramfs(kernel, build / "initramfs.gz")
                fields = recipe.make_rootfs(build, kernel, guest_files, step)
                step("boot and snapshot")
                plan = MachinePlan(cpus=recipe.cpus, memory_mb=recipe.memory_mb,
                                   env=dict(fields.get("env") or {}))
                image, boot_ms = run(runtime(settings).boot_image(digest, plan))
            except BaseException:
                shutil.rmtree(build, ignore_errors=True)
                raise
            info = TemplateInfo(name=recipe.name, hash=digest, memory_mb=recipe.memory_mb,
                                cpus=recipe.cpus, built_at=now(), kernel=kernel.version,
                                boot_ms=boot_ms, device_model=image.machine.device_model,
                                machine=image.machine.to_dict(), **fields)
            (build / "spec.json").write_text(recipe.record)
            done.write_text(info.model_dump_json(indent=2))
            step(f"built ({digest}, boot {boot_ms / 1000:.1f}s)")
        run(runtime(settings).publish_template(image_of(info), info.model_dump(mode="json")))
        store.index.mkdir(parents=True, exist_ok=True)
        tmp = store.index / f"{recipe.name}.json.tmp"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(store.index / f"{recipe.name}.json")
    return info


def build_image_template(layout: Path, digest: str, name: str, *, source: str,
                         settings: Settings, memory_mb: int = 512, cpus: int = 1,
                         disk_mb: int | None = None, force: bool = False, quiet: bool = False,
                         step: Step | None = None,
                         runtime: Callable[[Settings], Runtime] = _qemu_runtime,
                         run: Callable[[Coroutine], Any] = asyncio.run) -> TemplateInfo:
    """A template from the OCI image in `layout` (identified by `digest`, e.g. its manifest
    digest): its filesystem with sandlot's guest files, booted once and captured. `source`
    is what the template says it came from (the pinned reference, or the Dockerfile)."""
    key = _image_key(digest, memory_mb, cpus, disk_mb)

    def content(guest_files: GuestFiles) -> str:
        return _image_content(key, guest_files)

    def make_rootfs(build: Path, kernel: Kernel, guest_files: GuestFiles, step: Step) -> dict:
        step("root filesystem from the image")
        config = build_image_rootfs(layout, build / "rootfs.ext4", kernel, guest_files, disk_mb)
        return {"env": config.env, "workdir": config.workdir, "user": config.user,
                "entrypoint": config.entrypoint, "cmd": config.cmd, "image": source}

    recipe = _Recipe(name=name, content=content, make_rootfs=make_rootfs,
                     memory_mb=memory_mb, cpus=cpus, record=key)
    return _build(recipe, settings, force=force, quiet=quiet, runtime=runtime, step=step,
                  run=run)


def _image_key(digest: str, memory_mb: int, cpus: int, disk_mb: int | None) -> str:
    return json.dumps({"image": digest, "memory_mb": memory_mb, "cpus": cpus,
                       "disk_mb": disk_mb, "builder": IMAGE_BUILDER_VERSION}, sort_keys=True)


def _image_content(key: str, guest_files: GuestFiles) -> str:
    return hashlib.sha256(key.encode() + _environment_hash(guest_files)).hexdigest()[:16]


def image_template_current(info: TemplateInfo, digest: str, images: Path) -> bool:
    """Whether a create's template of image `digest` was built by this sandlot (its guest
    files, initramfs, machine): after an upgrade the next create rebuilds it."""
    expected = _image_content(_image_key(digest, 512, 1, None), _guest_files(images))
    return info.hash.split("-", 1)[0] == expected


def image_template_name(ref: oci.Reference) -> str:
    """The template a create from an image uses: one per image digest."""
    assert ref.digest
    return IMAGE_TEMPLATE_PREFIX + ref.digest.removeprefix("sha256:")[:16]


def pull_image_template(reference: str, name: str | None = None, *, settings: Settings,
                        access: oci.Access | None = None, memory_mb: int = 512,
                        cpus: int = 1, disk_mb: int | None = None, force: bool = False,
                        quiet: bool = False, step: Step | None = None,
                        runtime: Callable[[Settings], Runtime] = _qemu_runtime,
                        run: Callable[[Coroutine], Any] = asyncio.run,
                        layout: Path | None = None) -> TemplateInfo:
    """A template from an image in a registry: the reference pinned to its digest now,
    pulled once (kept by digest under images/oci/, or into `layout`), built once per digest.
    `name` defaults to `image_template_name`. ImageError for a bad reference or a refusing
    registry, ImageNotFoundError for an image the registry does not have."""
    access = access or registry_access(settings)
    ref = oci.parse_reference(reference)
    with (contextlib.nullcontext(step) if step else _progress(f"image {reference}", quiet)
          ) as step:
        layout, pinned = _pull(ref, settings, access, step, layout)
        assert pinned.digest
        return build_image_template(layout, pinned.digest,
                                    name or image_template_name(pinned),
                                    source=pinned.pinned, settings=settings,
                                    memory_mb=memory_mb, cpus=cpus, disk_mb=disk_mb,
                                    force=force, quiet=quiet, step=step, runtime=runtime,
                                    run=run)


def _pull(ref: oci.Reference, settings: Settings, access: oci.Access,
          step: Step, layout: Path | None = None) -> tuple[Path, oci.Reference]:
    """The image `ref` names now, in an OCI layout of this host (pulled once per digest),
    or in `layout`."""
    step(f"resolving {ref.text}")
    pinned = oci.resolve(ref, access)
    assert pinned.digest
    layout = layout or settings.images / "oci" / pinned.digest.removeprefix("sha256:")
    if not (layout / "index.json").exists():
        step(f"pulling {pinned.pinned}")
    oci.pull(pinned, layout, access)
    return layout, pinned


def dockerfile_template(dockerfile: Path, context: Path | None, name: str, *,
                        settings: Settings, access: oci.Access | None = None,
                        build_args: dict[str, str] | None = None, memory_mb: int = 512,
                        cpus: int = 1, disk_mb: int | None = None, force: bool = False,
                        quiet: bool = False, warn: Callable[[str], None] = log.warning,
                        runtime: Callable[[Settings], Runtime] = _qemu_runtime
                        ) -> TemplateInfo:
    """A template from a Dockerfile (`context` defaults to its folder): built by buildah,
    each step cached, then made a template like any image (by its image id).
    BuildStepError for an instruction that fails (with its output)."""
    access = access or registry_access(settings)
    build_args = dict(build_args or {})
    context = context or dockerfile.parent
    if not NAME_RE.match(name):
        raise InvalidArgumentError(f"invalid template name {name!r}")
    try:
        text = dockerfile.read_text()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {dockerfile}: {e.strerror}") from e
    if not context.is_dir():
        raise InvalidArgumentError(f"build context {context} is not a directory")
    with _progress(f"template {name}", quiet) as step:
        def pull(reference: str) -> Path:
            return _pull(oci.parse_reference(reference), settings, access, step)[0]

        prepared = dockerfile_mod.prepare(text, build_args, pull)
        for warning in prepared.warnings:
            warn(warning)
        buildah = dockerfile_mod.Buildah(settings.images / "buildah", settings.buildah_driver)
        image_id = buildah.build(prepared.text, context, build_args, step)
        layout = buildah.push(image_id, settings.images / "oci" /
                              ("built-" + image_id.removeprefix("sha256:")))
        return build_image_template(layout, image_id, name, source=f"Dockerfile {dockerfile}",
                                    settings=settings, memory_mb=memory_mb, cpus=cpus,
                                    disk_mb=disk_mb, force=force, quiet=quiet, step=step,
                                    runtime=runtime)


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
        if settings.db_path.exists() or settings.database_url:
            async def in_use(db) -> set:
                return ({d.get("build") or d.get("base")
                         for d in await db.snapshots(("creating", "uploading", "ready"))} |
                        {d.get("build") or d.get("base")
                         for d in await db.sandboxes(("starting", "running", "paused"))})

            keep |= run_sync(with_store(settings.database_url, settings.db_path, in_use))
        unused = sorted(b.name for b in store.builds.iterdir()
                        if b.is_dir() and b.name not in keep)
        if not dry_run:
            for name in unused:
                shutil.rmtree(store.builds / name, ignore_errors=True)
        layouts = _unused_layouts(store, keep)
        if not dry_run:
            for layout in layouts:
                shutil.rmtree(layout, ignore_errors=True)
    return unused + [f"oci/{p.name}" for p in layouts]


LAYOUT_GRACE = 3600  # s: a layout this new may be about to be built (a Dockerfile's push)


def _unused_layouts(store: TemplateStore, keep: set[str]) -> list[Path]:
    """The pulled or built OCI layouts (images/oci/) no kept build was made from."""
    root = store.root / "oci"
    if not root.is_dir():
        return []
    wanted = set()
    for build in keep:
        try:
            record = json.loads((store.builds / build / "spec.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("image"), str):
            wanted.add(record["image"].removeprefix("sha256:"))
    old = time.time() - LAYOUT_GRACE
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.removeprefix("built-") not in wanted
                  and p.stat().st_mtime < old)


def list_templates(data_dir: Path | None = None) -> list[TemplateInfo]:
    return TemplateStore(Settings.from_env(data_dir)).list()


def remove_template(name: str, data_dir: Path | None = None) -> None:
    TemplateStore(Settings.from_env(data_dir)).remove(name)


__all__ = ["TemplateStore", "registry_access", "build_template", "build_image_template",
           "pull_image_template",
           "dockerfile_template",
           "list_templates", "remove_template", "collect_garbage"]
