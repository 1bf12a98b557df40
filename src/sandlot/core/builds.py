"""Template builds through the API (E2B's template builder): a tenant names a template,
uploads the files its COPY steps need, starts a build of a base image plus steps, and polls
its status and logs; the result is a sandlot template of that name, owned by the tenant.

A build is a Dockerfile made from the steps (images/steps.py), built by buildah with the
uploads as its context (each step cached), then made a template like any image
(`templates.build_image_template`, cached by image id). Builds run one at a time on this
host, in a thread, bounded by the limits (`Limits.build_*`). Build records live in memory:
a restart forgets the builds in progress (their templates stay once built).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sandlot.config import Settings
from sandlot.core.models import (
    CreateSandbox,
    ExecRequest,
    SnapshotState,
    TemplateInfo,
    now,
)
from sandlot.core.templates import IMAGE_TEMPLATE_PREFIX, TemplateStore, visible
from sandlot.core.tenancy import Principal, tenant_of
from sandlot.errors import (
    BuildError,
    BuildStepError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SandlotError,
)
from sandlot.images import oci, steps
from sandlot.images.dockerfile import Buildah
from sandlot.images.spec import NAME_RE
from sandlot.runtime.base import Exited, Output, Runtime

log = logging.getLogger(__name__)
MAX_LOG_LINES = 20000
KEPT_BUILDS = 256  # finished builds remembered (their status and logs)
_STEP_LINE = re.compile(r"^STEP (\d+)/(\d+): ")
_BUILDAH_NOISE = ("COMMIT", "--> ", "Getting image source", "Copying ", "Writing manifest",
                  "Storing signatures", "subprocess exited")


@dataclass(frozen=True)
class BuildSpec:
    """What a build makes: a base image (a reference) and steps on it."""

    image: str
    steps: list[steps.Step]
    username: str | None = None  # registry credentials for the base image
    password: str | None = None
    force: bool = False  # rebuild every step
    start_cmd: str | None = None
    ready_cmd: str | None = None


@dataclass
class LogLine:
    at: datetime
    level: str
    message: str


@dataclass
class Build:
    build_id: str
    name: str
    owner: str
    cpus: int
    memory_mb: int
    tags: list[str]
    status: str = "waiting"  # waiting -> building -> ready | error
    logs: list[LogLine] = field(default_factory=list)
    reason: str | None = None
    reason_step: str | None = None  # the failed step, 1-based (E2B's "step")
    created_at: datetime = field(default_factory=now)
    task: asyncio.Task | None = None

    def log(self, message: str, level: str = "info") -> None:
        if len(self.logs) < MAX_LOG_LINES:
            self.logs.append(LogLine(now(), level, message))


def template_name(name: str) -> tuple[str, str | None]:
    """E2B's ``name[:tag]`` as (template name, tag); InvalidArgumentError if sandlot cannot
    name a template so."""
    base, _, tag = (name or "").partition(":")
    if not NAME_RE.fullmatch(base):
        raise InvalidArgumentError(f"invalid template name {base[:64]!r}: lowercase letters, "
                                   "digits, '.', '_' or '-', at most 63")
    if base.startswith(IMAGE_TEMPLATE_PREFIX):
        raise InvalidArgumentError(f"template names starting with {IMAGE_TEMPLATE_PREFIX!r} "
                                   "are sandlot's own")
    return base, tag or None


class TemplateBuilds:
    def __init__(self, settings: Settings, templates: TemplateStore,
                 runtime: Runtime | None) -> None:
        self.settings = settings
        self.templates = templates
        self.runtime = runtime
        self.uploads_root = settings.images / "uploads"
        self._builds: dict[str, Build] = {}
        self._upload_tokens: dict[str, tuple[str, str, float]] = {}
        self._one_at_a_time = asyncio.Semaphore(1)
        self.core: Any = None  # the Core it builds for (start commands run in its sandboxes)

    # ---- names ------------------------------------------------------------------------

    def _check_name_free(self, name: str, who: Principal) -> None:
        """A tenant may build a name it owns or that nobody has; not the operator's shared
        templates, nor another tenant's (PermissionDeniedError: E2B's 403)."""
        try:
            info = self.templates.get(name)
        except NotFoundError:
            info = None
        if info is not None and not who.admin and info.owner != who.tenant:
            raise PermissionDeniedError(f"template {name!r} exists and is not yours")
        for b in self._builds.values():
            if b.name == name and b.status in ("waiting", "building") and b.owner != who.tenant:
                raise PermissionDeniedError(f"template {name!r} is being built by another "
                                            "team")

    def request(self, name: str, tags: list[str] | None, cpus: int | None,
                memory_mb: int | None, min_free_disk_mb: int | None,
                who: Principal) -> Build:
        """A new build of template `name` (E2B's ``name[:tag]``), waiting for its steps."""
        base, tag = template_name(name)
        lim = self.settings.limits
        cpus = cpus or 2
        memory_mb = memory_mb or 1024
        if not 1 <= cpus <= lim.build_cpus:
            raise InvalidArgumentError(f"cpuCount must be 1 to {lim.build_cpus}")
        if not 128 <= memory_mb <= lim.build_memory_mb:
            raise InvalidArgumentError(f"memoryMB must be 128 to {lim.build_memory_mb}")
        if min_free_disk_mb is not None and not 0 <= min_free_disk_mb <= lim.build_disk_mb:
            raise InvalidArgumentError(f"minFreeDiskMb must be 0 to {lim.build_disk_mb}")
        tags = [t for t in [tag, *(tags or [])] if t]
        for t in tags:
            if not NAME_RE.fullmatch(t):
                raise InvalidArgumentError(f"invalid tag {t[:64]!r}")
        self._check_name_free(base, who)
        running = [b for b in self._builds.values()
                   if b.owner == who.tenant and b.status in ("waiting", "building")
                   and b.task is not None]
        if lim.key_builds and len(running) >= lim.key_builds:
            raise ConflictError(f"{len(running)} builds of yours are running; at most "
                                f"{lim.key_builds} at once")
        self._forget_old()
        build = Build(build_id=str(uuid.uuid4()), name=base, owner=who.tenant, cpus=cpus,
                      memory_mb=memory_mb, tags=tags or ["default"])
        self._builds[build.build_id] = build
        return build

    def _forget_old(self) -> None:
        done = [b for b in self._builds.values() if b.status in ("ready", "error")]
        for b in done[:max(0, len(done) - KEPT_BUILDS)]:
            self._builds.pop(b.build_id, None)

    def get(self, name: str, build_id: str, who: Principal) -> Build:
        build = self._builds.get(build_id)
        if build is None or build.name != name.partition(":")[0] \
                or not who.sees(build.owner):
            raise NotFoundError(f"build {build_id[:64]!r} of template {name[:64]!r} not found")
        return build

    def lookup(self, name: str, who: Principal) -> TemplateInfo:
        """A template by E2B name; PermissionDeniedError if it is another tenant's."""
        base, _ = template_name(name)
        info = self.templates.get(base)
        if not visible(info, who):
            raise PermissionDeniedError(f"template {base!r} is not yours")
        return info

    async def delete(self, name: str, who: Principal) -> None:
        """Remove a template the tenant built (an operator's: the CLI removes those)."""
        base, _ = template_name(name)
        info = self.templates.get(base)
        if not visible(info, who):
            raise NotFoundError(f"template {base!r} not found")
        if info.owner is None and not who.admin:
            raise PermissionDeniedError(f"{base!r} is a template of this server's operator; "
                                        "it is removed on the server (`sandlot template rm`)")
        self.templates.remove(base)
        if info.snapshot_id:
            await self._drop_snapshot(info)

    # ---- uploads ----------------------------------------------------------------------

    def _upload_dir(self, tenant: str, files_hash: str) -> Path:
        safe = hashlib.sha256(tenant.encode()).hexdigest()[:16]
        return self.uploads_root / safe / files_hash

    def upload_link(self, name: str, files_hash: str, who: Principal) -> tuple[bool, str]:
        """Whether `who` uploaded these files already, and a token to PUT them with."""
        template_name(name)
        if not steps.HASH_RE.fullmatch(files_hash or ""):
            raise InvalidArgumentError(f"invalid files hash {files_hash[:80]!r}")
        present = self._upload_dir(who.tenant, files_hash).is_dir()
        token = secrets.token_urlsafe(24)
        if len(self._upload_tokens) > 10000:
            self._upload_tokens.pop(next(iter(self._upload_tokens)))
        self._upload_tokens[token] = (who.tenant, files_hash, time.monotonic() + 3600)
        return present, token

    async def upload(self, token: str, body: AsyncIterator[bytes]) -> None:
        """Store the tar (optionally gzipped) a COPY's files came in, unpacked."""
        entry = self._upload_tokens.get(token)
        if entry is None or entry[2] < time.monotonic():
            raise NotFoundError("unknown or expired upload link")
        tenant, files_hash, _ = entry
        limit = self.settings.limits.build_upload_bytes
        target = self._upload_dir(tenant, files_hash)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as f:
            size = 0
            async for chunk in body:
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"an upload is at most {limit} bytes")
                f.write(chunk)
            f.seek(0)
            await asyncio.to_thread(_unpack, f, target)
        self._upload_tokens.pop(token, None)

    # ---- builds -----------------------------------------------------------------------

    def start(self, name: str, build_id: str, spec: BuildSpec, who: Principal) -> Build:
        """Start a requested build in the background."""
        build = self.get(name, build_id, who)
        if build.task is not None:
            raise ConflictError(f"build {build_id} was started already")
        missing = [s.files_hash for s in spec.steps if s.kind == "COPY"
                   and not self._upload_dir(build.owner, s.files_hash or "").is_dir()]
        if missing:
            raise InvalidArgumentError(f"the files of hash {missing[0]} were not uploaded")
        if self.runtime is None:
            raise InvalidArgumentError("this server cannot build templates")
        oci.parse_reference(spec.image)  # a bad reference: 400 now, not a failed build
        build.task = asyncio.create_task(self._run(build, spec))
        return build

    async def _run(self, build: Build, spec: BuildSpec) -> None:
        loop = asyncio.get_running_loop()
        runtime = self.runtime
        assert runtime is not None

        def on_loop(coro):  # the boot and publish run on this server's runtime
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        def log(message: str, level: str = "info") -> None:
            loop.call_soon_threadsafe(build.log, message, level)

        build.log(f"Build {build.build_id} of template {build.name} queued")
        try:
            async with self._one_at_a_time:
                build.status = "building"
                deadline = time.monotonic() + self.settings.limits.build_seconds
                try:
                    before = self.templates.get(build.name)
                except NotFoundError:
                    before = None
                info = await asyncio.to_thread(self._build, build, spec, log, on_loop,
                                               lambda _: runtime, deadline)
                await asyncio.sleep(0)  # the thread's last log lines land first
                if spec.start_cmd or spec.ready_cmd:
                    await self._started(build, spec, info, before, deadline)
            await asyncio.sleep(0)
            build.status = "ready"
            build.log(f"Template {build.name} is ready")
        except Exception as e:  # noqa: BLE001 - every failure is the build's status
            await asyncio.sleep(0)
            message = e.message if isinstance(e, SandlotError) else f"build failed: {e}"
            if not isinstance(e, SandlotError):
                log.error("template build %s of %s failed", build.build_id, build.name,
                          exc_info=e)
            build.reason, build.status = message, "error"
            build.log(message, "error")

    def _build(self, build: Build, spec: BuildSpec, log: Callable[..., None], on_loop,
               runtime: Callable[[Settings], Runtime], deadline: float) -> TemplateInfo:
        from sandlot.core import templates

        settings = self.settings
        access = oci.Access.from_env(creds=f"{spec.username}:{spec.password}"
                                     if spec.username and spec.password else None)
        ref = oci.parse_reference(spec.image)
        log(f"Base image {spec.image}")
        layout, pinned = templates._pull(ref, settings, access, log)
        text, origin = steps.dockerfile(f"oci:{layout}:{oci.TAG}", spec.steps)
        counts = {"steps": 0, "cached": 0}
        seen: set[int] = set()

        def output(line: str) -> None:
            m = _STEP_LINE.match(line)
            if m:
                counts["steps"] += 1
                k = int(m.group(1))
                n = origin[k - 1] if k <= len(origin) else 0
                if n and n not in seen:
                    seen.add(n)
                    s = spec.steps[n - 1]
                    log(f"[{n}/{len(spec.steps)}] {s.kind} {' '.join(s.args)[:200]}")
            elif "Using cache" in line:
                counts["cached"] += 1
            elif not line.startswith(_BUILDAH_NOISE):
                log(line)

        context = self.uploads_root / hashlib.sha256(build.owner.encode()).hexdigest()[:16]
        context.mkdir(parents=True, exist_ok=True)
        buildah = Buildah(settings.images / "buildah")
        try:
            image_id = buildah.build(text, context, {}, lambda _: None, output=output,
                                     no_cache=spec.force,
                                     timeout=max(1.0, deadline - time.monotonic()))
        except SandlotError as e:
            m = re.search(r"STEP (\d+)/", e.message)
            if m and int(m.group(1)) <= len(origin) and origin[int(m.group(1)) - 1]:
                build.reason_step = str(origin[int(m.group(1)) - 1])
            raise
        if counts["cached"] >= counts["steps"] - 1 and not spec.force:
            log("Every step was cached")
        out = buildah.push(image_id, settings.images / "oci" /
                           ("built-" + image_id.removeprefix("sha256:")))
        if time.monotonic() > deadline:
            raise InvalidArgumentError("the build ran past its time limit")

        def step(text: str) -> None:
            if text.startswith("up to date"):
                log(f"Template {build.name}: served from the cache ({text})")
            elif text.startswith(("built", "boot and snapshot")):
                log(f"Template {build.name}: {text}")

        return templates.build_image_template(
            out, image_id, build.name, source=f"e2b build of {pinned.pinned}",
            settings=settings, memory_mb=build.memory_mb, cpus=build.cpus,
            force=spec.force, step=step, runtime=runtime, run=on_loop, owner=build.owner)

    async def _started(self, build: Build, spec: BuildSpec, info: TemplateInfo,
                       before: TemplateInfo | None, deadline: float) -> None:
        """E2B's start and ready commands: a sandbox of the new build runs the start command
        until the ready command succeeds, and is snapshotted then; the template's sandboxes
        restore that snapshot (the start command running, as on E2B). An unchanged rebuild
        keeps the snapshot it made before."""
        if (before is not None and before.hash == info.hash and before.snapshot_id
                and (before.start_cmd, before.ready_cmd) == (spec.start_cmd, spec.ready_cmd)
                and before.owner == info.owner and not spec.force):
            build.log("Start command: served from the cache (its snapshot)")
            await self.templates.put(before)
            return
        c = self.core
        who = tenant_of(build.owner)
        build.log(f"Starting a sandbox for the start command: {spec.start_cmd or '(none)'}")
        rec = await c.sandboxes.create(CreateSandbox(template=build.name, timeout=3600),
                                       who=who)
        try:
            if spec.start_cmd:
                await c.commands.start(rec.sandbox_id, ExecRequest(
                    cmd=spec.start_cmd, background=True, timeout=0, stdin=""), who=who)
            if spec.ready_cmd:
                await self._wait_ready(build, rec.sandbox_id, spec.ready_cmd, who, deadline)
            snap = await c.sandboxes.snapshot(rec.sandbox_id, memory=True, who=who)
            snap = await c.snapshots.wait(snap.snapshot_id, max(60.0, deadline -
                                                                time.monotonic()), who=who)
            if snap.state != SnapshotState.READY:
                raise BuildError(f"the snapshot after the start command is {snap.state.value}")
        finally:
            with contextlib.suppress(SandlotError):
                await c.sandboxes.kill(rec.sandbox_id, who=who)
        info.start_cmd, info.ready_cmd = spec.start_cmd, spec.ready_cmd
        info.snapshot_id = snap.snapshot_id
        await self.templates.put(info)
        build.log("Snapshotted the sandbox with its start command running")
        if before is not None and before.snapshot_id:
            await self._drop_snapshot(before)

    async def _wait_ready(self, build: Build, sandbox_id: str, ready_cmd: str,
                          who: Principal, deadline: float) -> None:
        build.log(f"Waiting for the ready command: {ready_cmd}")
        last = ""
        while True:
            code, out = None, []
            async for event in self.core.commands.run(sandbox_id, ExecRequest(
                    cmd=ready_cmd, timeout=60), who=who):
                if isinstance(event, Output):
                    out.append(event.data.decode(errors="replace"))
                elif isinstance(event, Exited):
                    code = event.exit_code
            if code == 0:
                build.log("The ready command succeeded")
                return
            last = "".join(out)[-2000:]
            if time.monotonic() > deadline:
                raise BuildStepError(f"the ready command {ready_cmd!r} did not succeed within "
                                     f"the build's time limit; its last output:\n{last}")
            await asyncio.sleep(1)

    async def _drop_snapshot(self, info: TemplateInfo) -> None:
        assert info.snapshot_id
        with contextlib.suppress(SandlotError):
            await self.core.snapshots.delete(info.snapshot_id, who=tenant_of(info.owner))


def _unpack(f, target: Path) -> None:
    """A tar (gzipped or not) into `target`, only regular files, folders and links inside
    it (tarfile's "data" filter); InvalidArgumentError if it is not one."""
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        try:
            with tarfile.open(fileobj=f, mode="r:*") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            raise InvalidArgumentError(f"the upload is not a tar archive: {e}") from None
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["TemplateBuilds", "BuildSpec", "Build", "template_name"]
