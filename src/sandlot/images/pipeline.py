"""The template build pipeline (offline: the CLI's `sandlot template build`, and a create
from an OCI image on the server): a guest image from a spec, an OCI image or a Dockerfile,
booted once on a runtime and captured, then published and named in the template index
(core/templates.py reads it). Every build takes one path (`_build`), cached by content hash.

Layout under the images dir::

    kernel/<version>/          unpacked Debian cloud kernel (shared by builds)
    builds/<hash>/             vmlinuz, initramfs.gz, rootfs.ext4, spec.json, store/ (snapshot)
    templates/<name>.json      TemplateInfo: name -> build hash
    oci/<digest>/              the OCI images pulled (or built from a Dockerfile)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sandlot import filelock
from sandlot.config import Settings
from sandlot.core.models import TemplateInfo, now
from sandlot.errors import InvalidArgumentError, InvalidStateError
from sandlot.images import dockerfile as dockerfile_mod
from sandlot.images import initramfs as initramfs_mod
from sandlot.images import oci
from sandlot.images.guest import build_guest
from sandlot.images.guest import hash_input as guest_hash_input
from sandlot.images.imagefs import build_image_rootfs
from sandlot.images.initramfs import build_initramfs
from sandlot.images.kernel import Kernel, ensure_kernel
from sandlot.images.rootfs import build_rootfs
from sandlot.images.spec import IMAGE_TEMPLATE_PREFIX, NAME_RE, TemplateSpec, base_spec
from sandlot.runtime.base import Image, MachineDescription, MachinePlan, Runtime
from sandlot.vmm.machine import DEVICE_MODEL
from sandlot.vmm.qemu import qemu_info

log = logging.getLogger(__name__)
BUILD_LOCK = ".build.lock"  # held by a build, and by the GC (images/gc.py)
IMAGE_BUILDER_VERSION = "1"  # bump when a build from an image changes in a way its digest
# does not show


def registry_access(settings: Settings) -> oci.Access:
    """How this server's image pulls reach registries (its settings)."""
    return oci.Access.of(settings.insecure_registries, None, settings.registry_auth_file,
                         settings.registries)


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
    root, index = settings.images, settings.images / "templates"
    root.mkdir(parents=True, exist_ok=True)
    label = f"template {recipe.name}"
    # One build at a time per images dir, across processes.
    with filelock.exclusive(root / BUILD_LOCK), \
            (contextlib.nullcontext(step) if step else _progress(label, quiet)) as step:
        step("kernel")
        kernel = ensure_kernel(root / "kernel")
        step("guest agent and init")
        guest_files = _guest_files(root)
        digest = (recipe.content(guest_files) + "-"
                  + hashlib.sha256(kernel.version.encode()).hexdigest()[:4])
        build = root / "builds" / digest
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
        index.mkdir(parents=True, exist_ok=True)
        tmp = index / f"{recipe.name}.json.tmp"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(index / f"{recipe.name}.json")
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


__all__ = ["registry_access", "image_of", "build_template", "build_image_template",
           "pull_image_template", "dockerfile_template", "image_template_current",
           "image_template_name"]
