"""Template builds through the API (E2B's template builder): a tenant names a template,
uploads the files its COPY steps need, starts a build of a base image plus steps, and polls
its status and logs; the result is a sandlot template of that name, owned by the tenant.

A build runs inside a sandbox, never on the host: a sandbox of the base image (pulled and
made a template as any create from an image is, as the tenant: its registry rules, its
limits), E2B's `user` account made in it, the steps run in it through the guest agent (RUN
as commands, COPY as file writes of the uploads, ENV/WORKDIR/USER as the state the next step
runs in), the start command started and the ready command awaited, then one snapshot: the
template's sandboxes restore it. Cached whole by the pinned base image and the steps. Builds
run one at a time on this host, bounded by the limits (`Limits.build_*`). Build records and
their logs are kept in the metadata store, so every host of a deployment answers a build's
status and a restart forgets no finished build (one that was running fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import posixpath
import secrets
import shlex
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from sandlot.config import Settings
from sandlot.core.background import stop_task
from sandlot.core.db import MetadataStore
from sandlot.core.models import (
    CreateSandbox,
    ExecRequest,
    SnapshotState,
    TemplateInfo,
    now,
)
from sandlot.core.templates import DEFAULT_TAG, TemplateStore, owned, visible
from sandlot.core.tenancy import Principal, tenant_of
from sandlot.errors import (
    BuildError,
    BuildStepError,
    CommandTimeoutError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SandlotError,
)
from sandlot.images import dockersteps, ecr, oci, steps
from sandlot.images.pipeline import registry_access
from sandlot.images.spec import IMAGE_TEMPLATE_PREFIX, NAME_RE
from sandlot.runtime.base import Exited, Output, Runtime

log = logging.getLogger(__name__)
MAX_LOG_LINES = 20000
PULLED_PREFIX = IMAGE_TEMPLATE_PREFIX + "t"  # an image pulled with a tenant's login
KEPT_SECONDS = 7 * 86400  # a finished build's status and logs are kept a week
MAX_UNSTARTED = 32  # builds a tenant requested and has not started
UNSTARTED_TTL = 3600  # s: a requested build not started by then is forgotten
SAVE_INTERVAL = 1.0  # s between saves of a running build's new log lines
OUTPUT_TAIL = 60  # lines of a failed step's output in its error
STEPS_VERSION = "1"  # bump when the steps run differently for the same input


@dataclass(frozen=True)
class RegistryLogin:
    """Credentials for the registry of one build's base image (E2B's ``fromImageRegistry``):
    used for that build's pull only, kept in memory for its length, never saved or shown."""

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class BuildSpec:
    """What a build makes: a base (an image reference, or a template the builder may use)
    and steps on it."""

    image: str | None
    steps: list[steps.Step]
    template: str | None = None
    force: bool = False  # rebuild every step
    start_cmd: str | None = None
    ready_cmd: str | None = None
    login: RegistryLogin | ecr.Keys | None = None  # for `image`'s registry


@dataclass
class LogLine:
    at: datetime
    level: str
    message: str

    def to_doc(self) -> dict:
        return {"at": self.at.isoformat(), "level": self.level, "message": self.message}

    @classmethod
    def from_doc(cls, doc: dict) -> LogLine:
        return cls(datetime.fromisoformat(doc["at"]), doc["level"], doc["message"])


# fields of a build kept in its record (the logs are kept line by line beside it)
RECORD_FIELDS = ("build_id", "name", "owner", "cpus", "memory_mb", "tags", "status", "reason",
                 "reason_step", "error", "started", "host")


@dataclass
class Build:
    build_id: str
    name: str
    owner: str
    cpus: int
    memory_mb: int
    tags: list[str]
    status: str = "waiting"  # waiting -> building -> ready | error
    logs: list[LogLine] = field(default_factory=list)  # this host's builds only
    reason: str | None = None
    reason_step: str | None = None  # the failed step, 1-based (E2B's "step")
    error: str | None = None  # the class name of the error it failed with
    created_at: datetime = field(default_factory=now)
    started: bool = False
    host: str = ""  # the host that runs it (that requested it, until it starts)
    saved_logs: int = 0  # log lines in the metadata store
    task: asyncio.Task | None = None

    def log(self, message: str, level: str = "info") -> None:
        if len(self.logs) < MAX_LOG_LINES:
            self.logs.append(LogLine(now(), level, message))

    @property
    def state(self) -> str:
        """Its state in the metadata store: `requested` until it starts, then its status."""
        return self.status if self.started else "requested"

    def to_doc(self) -> dict:
        return {**{f: getattr(self, f) for f in RECORD_FIELDS},
                "created_at": self.created_at.isoformat(), "log_count": self.saved_logs}

    @classmethod
    def from_doc(cls, doc: dict) -> Build:
        return cls(**{f: doc[f] for f in RECORD_FIELDS if f in doc},
                   created_at=datetime.fromisoformat(doc["created_at"]),
                   saved_logs=int(doc.get("log_count") or 0))


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
    """Template builds: requested and read on any host (their records are in the metadata
    store `db`), run on the host that starts them."""

    def __init__(self, settings: Settings, templates: TemplateStore,
                 runtime: Runtime | None, db: MetadataStore, host_id: str = "") -> None:
        self.settings = settings
        self.templates = templates
        self.runtime = runtime
        self.db = db
        self.host_id = host_id
        self.uploads_root = settings.images / "uploads"
        self._builds: dict[str, Build] = {}  # the builds this host runs, until they end
        self._saving = asyncio.Lock()
        self._upload_tokens: dict[str, tuple[str, str, float]] = {}
        self._one_at_a_time = asyncio.Semaphore(1)
        self.core: Any = None  # the Core it builds for (start commands run in its sandboxes)

    # ---- names ------------------------------------------------------------------------

    async def _check_name_free(self, name: str, who: Principal, running: list[Build]
                               ) -> None:
        """A tenant may build a name it owns or that nobody has; not the operator's shared
        templates, nor another tenant's (PermissionDeniedError: E2B's 403). `running`: the
        deployment's builds that are waiting or building."""
        try:
            info: TemplateInfo | None = await self.templates.current(name)
        except NotFoundError:
            info = None
        if info is not None and not who.admin and info.owner != who.tenant:
            raise PermissionDeniedError(f"template {name!r} exists and is not yours")
        for b in running:
            if b.name == name and b.owner != who.tenant:
                raise PermissionDeniedError(f"template {name!r} is being built by another "
                                            "team")

    async def request(self, name: str, tags: list[str] | None, cpus: int | None,
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
        # `name` is `name:default` (E2B): a build of it moves the default tag too
        tags = list(dict.fromkeys(t for t in [tag or DEFAULT_TAG, *(tags or [])] if t))
        for t in tags:
            if not NAME_RE.fullmatch(t):
                raise InvalidArgumentError(f"invalid tag {t[:64]!r}")
        await self._forget_old()  # first: the one listing below has no expired requests
        unfinished = [Build.from_doc(d) for d in
                      await self.db.builds(("requested", "waiting", "building"))]
        running = [b for b in unfinished if b.state != "requested"]
        await self._check_name_free(base, who, running)
        mine = sum(1 for b in running if b.owner == who.tenant)
        if lim.key_builds and mine >= lim.key_builds:
            raise ConflictError(f"{mine} builds of yours are running; at most "
                                f"{lim.key_builds} at once")
        if sum(1 for b in unfinished
               if b.state == "requested" and b.owner == who.tenant) >= MAX_UNSTARTED:
            raise ConflictError(f"{MAX_UNSTARTED} builds of yours were requested and not "
                                "started; start them or wait an hour")
        build = Build(build_id=str(uuid.uuid4()), name=base, owner=who.tenant, cpus=cpus,
                      memory_mb=memory_mb, tags=tags, host=self.host_id)
        await self._save(build)
        return build

    async def _forget_old(self) -> None:
        """Finished builds older than KEPT_SECONDS, and builds never started within
        UNSTARTED_TTL seconds."""
        await self.db.drop_builds(("requested",), time.time() - UNSTARTED_TTL)
        await self.db.drop_builds(("ready", "error"), time.time() - KEPT_SECONDS)

    async def recover(self) -> None:
        """At start: the builds this host ran when it stopped failed with it."""
        for doc in await self.db.builds(("waiting", "building"), host=self.host_id):
            build = Build.from_doc(doc)
            build.status, build.error = "error", "BuildError"
            build.reason = "the server restarted during the build"
            await self._save(build)

    async def _save(self, build: Build) -> None:
        """A build's record and its new log lines into the metadata store (lines first: a
        reader that sees it finished sees all of them)."""
        async with self._saving:
            count = len(build.logs)
            if count > build.saved_logs:
                await self.db.add_build_logs(build.build_id, build.saved_logs,
                                             [line.to_doc() for line in
                                              build.logs[build.saved_logs:count]])
                build.saved_logs = count
            await self.db.put_build(build.build_id, build.state, build.host, build.to_doc(),
                                    build.created_at.timestamp())

    async def _save_while_running(self, build: Build) -> None:
        """Save a running build each SAVE_INTERVAL when its status or its logs changed."""
        saved: tuple[str, int] | None = None
        while True:
            await asyncio.sleep(SAVE_INTERVAL)
            seen = (build.status, len(build.logs))
            if seen == saved:
                continue
            try:
                await self._save(build)
                saved = seen
            except Exception as e:  # noqa: BLE001 - the next save tries again
                log.warning("build %s not saved: %s", build.build_id, e)

    async def get(self, name: str, build_id: str, who: Principal) -> Build:
        """A build of template `name`, from this host if it runs it, else from the metadata
        store (whichever host requested or ran it)."""
        build = self._builds.get(build_id)
        if build is None and len(build_id) <= 100:
            doc = await self.db.get_build(build_id)
            build = Build.from_doc(doc) if doc is not None else None
        if build is None or build.name != name.partition(":")[0] \
                or not who.sees(build.owner):
            raise NotFoundError(f"build {build_id[:64]!r} of template {name[:64]!r} not found")
        return build

    async def history(self, who: Principal, name: str | None = None) -> list[Build]:
        """The started builds `who` may see (of template `name`, or all), oldest first; a
        build this host runs as it is now."""
        out = []
        for doc in await self.db.builds(("waiting", "building", "ready", "error")):
            build = self._builds.get(doc["build_id"]) or Build.from_doc(doc)
            if who.sees(build.owner) and name in (None, build.name):
                out.append(build)
        return out

    async def logs(self, build: Build, offset: int, limit: int) -> list[LogLine]:
        """Lines `offset` to `offset + limit` of a build's logs."""
        if self._builds.get(build.build_id) is build:
            return build.logs[offset:offset + limit]
        return [LogLine.from_doc(d) for d in await self.db.build_logs(build.build_id, offset,
                                                                      limit)]

    async def tail(self, build: Build, count: int) -> list[LogLine]:
        """The last `count` lines of a build's logs."""
        total = len(build.logs) if self._builds.get(build.build_id) is build \
            else build.saved_logs
        return await self.logs(build, max(0, total - count), count)

    async def lookup(self, name: str, who: Principal) -> TemplateInfo:
        """A template by E2B name; PermissionDeniedError if it is another tenant's."""
        base, _ = template_name(name)
        info = await self.templates.current(base)
        if not visible(info, who):
            raise PermissionDeniedError(f"template {base!r} is not yours")
        return info

    async def delete(self, name: str, who: Principal) -> None:
        """Remove a template the tenant built, or an image it pulled with its own registry
        login (`image-t...`, its own alone); an operator's: the CLI removes those."""
        pulled = name.startswith(PULLED_PREFIX) and NAME_RE.fullmatch(name)
        base = name if pulled else template_name(name)[0]
        info = await self.templates.current(base)
        if not visible(info, who):
            raise NotFoundError(f"template {base!r} not found")
        _check_owner(info, who, "it is removed on the server (`sandlot template rm`)")
        tagged = await self.templates.tagged(base)
        for tag in tagged:
            if tag != DEFAULT_TAG:
                await self.templates.put_tag(base, tag, None)
        await self.templates.delete(base)
        for snapshot in {i.snapshot_id: i for i in tagged.values() if i.snapshot_id}.values():
            await self._drop_snapshot(snapshot)

    # ---- tags (E2B's) -----------------------------------------------------------------

    async def _own(self, name: str, who: Principal,
                   operator: str = "its tags are not changed through the API") -> TemplateInfo:
        """A build (`name` or `name:tag`) of a template `who` built."""
        try:
            info = await self.templates.current(name)
        except NotFoundError:
            raise NotFoundError(f"template {name[:80]!r} not found") from None
        if not visible(info, who):
            raise NotFoundError(f"template {name[:80]!r} not found")
        _check_owner(info, who, operator)
        return info

    async def set_public(self, name: str, public: bool | None, who: Principal
                         ) -> TemplateInfo:
        """Make a template `who` built public (every tenant may create from it) or private
        (E2B's template update; None: neither, the template as it is)."""
        base, _ = template_name(name)
        shared = "it is shared by every key already"
        info = await self._own(base, who, shared)
        if info.owner is None:  # an admin's key
            raise PermissionDeniedError(f"{base!r} is a template of this server's operator; "
                                        f"{shared}")
        if public is not None and public != info.public:
            await self.templates.set_public(info, public)
        return info

    async def tags(self, name: str, who: Principal) -> dict[str, TemplateInfo]:
        """A template's tags and the builds they name."""
        base, _ = template_name(name)
        tagged = await self.templates.tagged(base)
        if not tagged or not visible(next(iter(tagged.values())), who):
            raise NotFoundError(f"template {base!r} not found")
        return tagged

    async def assign_tags(self, target: str, tags: list[str], who: Principal
                          ) -> TemplateInfo:
        """Point `tags` of a template at the build `target` (``name:tag``; ``name``: its
        default tag) names; the build."""
        base, _ = template_name(target)
        if not tags:
            raise InvalidArgumentError("give at least one tag")
        for t in tags:
            if not NAME_RE.fullmatch(t or ""):
                raise InvalidArgumentError(f"invalid tag {str(t)[:64]!r}")
        info = await self._own(target, who)
        await self._point(base, list(dict.fromkeys(tags)), info)
        return info

    async def remove_tags(self, name: str, tags: list[str], who: Principal) -> None:
        """Remove tags of a template (not its default: delete the template instead)."""
        base, _ = template_name(name)
        if DEFAULT_TAG in tags:
            raise InvalidArgumentError(f"the {DEFAULT_TAG!r} tag is the template's own "
                                       "build; it is removed with the template")
        for t in tags:
            if not NAME_RE.fullmatch(t or ""):
                raise InvalidArgumentError(f"invalid tag {str(t)[:64]!r}")
        await self._own(base, who)
        tagged = await self.templates.tagged(base)
        for t in tags:
            if t in tagged:
                await self.templates.put_tag(base, t, None)
        await self._drop_unused(base, [tagged[t] for t in tags if t in tagged])

    async def _point(self, name: str, tags: list[str], info: TemplateInfo) -> None:
        """Point `tags` of template `name` at build `info`; the builds they named before
        are dropped when no tag names them any more."""
        before = await self.templates.tagged(name)
        for tag in tags:
            if tag == DEFAULT_TAG:
                await self.templates.put(info.model_copy(update={"name": name}))
            else:
                await self.templates.put_tag(name, tag, info)
        await self._drop_unused(name, [before[t] for t in tags if t in before])

    async def _drop_unused(self, name: str, infos: list[TemplateInfo]) -> None:
        used = {i.snapshot_id for i in (await self.templates.tagged(name)).values()}
        for snapshot in {i.snapshot_id: i for i in infos
                         if i.snapshot_id and i.snapshot_id not in used}.values():
            await self._drop_snapshot(snapshot)

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
            await asyncio.to_thread(_unpack, f, target, limit)
        self._upload_tokens.pop(token, None)
        await asyncio.to_thread(_keep_newest, target.parent,
                                self.settings.limits.build_uploads_bytes, target)

    async def store_context(self, context: bytes, who: Principal) -> str:
        """A build context (a tar, gzipped or not) in the tenant's uploads, unpacked; its
        files hash (of its bytes: the same context is stored once)."""
        limit = self.settings.limits.build_upload_bytes
        if len(context) > limit:
            raise PayloadTooLargeError(f"a build context is at most {limit} bytes")
        files_hash = hashlib.sha256(context).hexdigest()
        target = self._upload_dir(who.tenant, files_hash)
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile() as f:
                f.write(context)
                f.seek(0)
                await asyncio.to_thread(_unpack, f, target, limit)
            await asyncio.to_thread(_keep_newest, target.parent,
                                    self.settings.limits.build_uploads_bytes, target)
        return files_hash

    async def build_dockerfile(self, name: str, text: str, context: bytes | None,
                               cpus: int | None, memory_mb: int | None,
                               who: Principal) -> Build:
        """Build template `name` from a single-stage Dockerfile (images/dockersteps.py) and
        its context: FROM a template the tenant sees, else an image reference."""
        files_hash = await self.store_context(context, who) if context else None
        plan = dockersteps.convert(text, files_hash)
        base = plan.base
        template = None
        if NAME_RE.fullmatch(base.removesuffix(":latest")):
            try:
                info = await self.templates.current(base.removesuffix(":latest"))
            except NotFoundError:
                info = None
            if info is not None and visible(info, who):
                template = info.name
        if template is None:
            oci.parse_reference(base)  # a bad reference: 400 now
        build = await self.request(name, None, cpus, memory_mb, None, who)
        for warning in plan.warnings:
            build.log(warning, "warn")
        try:
            return await self.start(build.name, build.build_id, BuildSpec(
                image=None if template else base, template=template, steps=plan.steps), who,
                build=build)
        except SandlotError as e:  # answered to the caller; the record says why too
            build.status, build.reason, build.error = "error", e.message, type(e).__name__
            build.started = True
            await self._save(build)
            raise

    # ---- builds -----------------------------------------------------------------------

    async def start(self, name: str, build_id: str, spec: BuildSpec, who: Principal,
                    build: Build | None = None) -> Build:
        """Start a requested build (on whichever host it was requested) in the background,
        on this host."""
        build = build or await self.get(name, build_id, who)
        if build.started or build.task is not None:
            raise ConflictError(f"build {build_id} was started already")
        missing = [s.files_hash for s in spec.steps if s.kind == "COPY"
                   and not self._upload_dir(build.owner, s.files_hash or "").is_dir()]
        if missing:
            raise InvalidArgumentError(f"the files of hash {missing[0]} were not uploaded")
        if self.runtime is None:
            raise InvalidArgumentError("this server cannot build templates")
        if spec.template:
            if spec.template.partition(":")[0] == build.name:
                raise InvalidArgumentError("a template cannot be built from itself")
            await self.templates.info(spec.template.partition(":")[0], tenant_of(build.owner))
        else:  # a bad reference: 400 now, not a failed build
            oci.parse_reference(spec.image or "")
        if build.saved_logs > len(build.logs):  # requested elsewhere: its lines so far
            build.logs = [LogLine.from_doc(d) for d in await self.db.build_logs(
                build.build_id, 0, build.saved_logs)]
            build.saved_logs = len(build.logs)
        if self._builds.get(build.build_id, build) is not build:  # two starts at once
            raise ConflictError(f"build {build_id} was started already")
        build.started, build.host = True, self.host_id
        self._builds[build.build_id] = build
        build.log(f"Build {build.build_id} of template {build.name} queued")
        try:
            await self._save(build)
        except BaseException:
            self._builds.pop(build.build_id, None)
            raise
        build.task = asyncio.create_task(self._run(build, spec))
        return build

    async def _run(self, build: Build, spec: BuildSpec) -> None:
        saver = asyncio.create_task(self._save_while_running(build))
        try:
            await self._run_build(build, spec)
        finally:
            await stop_task(saver)
            try:
                await self._save(build)
            except Exception:  # noqa: BLE001 - a build's end is never lost silently
                log.exception("build %s (%s) not saved", build.build_id, build.status)
            self._builds.pop(build.build_id, None)

    async def _run_build(self, build: Build, spec: BuildSpec) -> None:
        try:
            async with self._one_at_a_time:
                build.status = "building"
                await self._save(build)
                await self._build(build, spec, time.monotonic()
                                  + self.settings.limits.build_seconds)
            build.status = "ready"
            build.log(f"Template {build.name} is ready")
        except Exception as e:  # noqa: BLE001 - every failure is the build's status
            message = e.message if isinstance(e, SandlotError) else f"build failed: {e}"
            if not isinstance(e, SandlotError):
                log.error("template build %s of %s failed", build.build_id, build.name,
                          exc_info=e)
            build.reason, build.status = message, "error"
            build.error = type(e).__name__ if isinstance(e, SandlotError) else "BuildError"
            build.log(message, "error")

    async def _build(self, build: Build, spec: BuildSpec, deadline: float) -> None:
        """The steps run in a sandbox of the base image (as the tenant: its limits, its
        registry rules, no host but the sandbox's own), which is then snapshotted; the
        template's sandboxes restore that snapshot. Cached whole, by the pinned base image,
        the steps (a COPY by its files hash) and the start and ready commands."""
        c, who = self.core, tenant_of(build.owner)
        if spec.template:  # built on a template: its build (and snapshot) is the base
            parent = await self.templates.info(spec.template.partition(":")[0], who)
            origin = f"template {parent.name}"
            base_id = f"{origin} {parent.hash} {parent.snapshot_id}"
            create = CreateSandbox(template=parent.name)
        elif spec.login is not None:  # the tenant's own credentials: a pull of its own
            ref = oci.parse_reference(spec.image or "")
            login = await self._registry_login(build, spec.login)
            with oci.login_file(ref, login.username, login.password) as path:
                name, pinned = await self.templates.private_image(
                    ref, replace(registry_access(self.settings), auth_file=path),
                    who)
            build.log(f"Base {pinned.pinned}: pulled with the build's registry credentials")
            origin, base_id = pinned.pinned, f"{pinned.pinned} {who.tenant}"
            create = CreateSandbox(template=name)
        else:
            access = registry_access(self.settings)
            pinned = await asyncio.to_thread(oci.resolve,
                                             oci.parse_reference(spec.image or ""), access)
            origin = base_id = pinned.pinned
            create = CreateSandbox(image=pinned.pinned)
        key = hashlib.sha256(json.dumps({
            "v": STEPS_VERSION, "base": base_id, "cpus": build.cpus,
            "memory_mb": build.memory_mb, "start": spec.start_cmd, "ready": spec.ready_cmd,
            "steps": [[s.kind, list(s.args), s.files_hash] for s in spec.steps]},
            sort_keys=True).encode()).hexdigest()[:24]
        try:
            before: TemplateInfo | None = await self.templates.current(
                f"{build.name}:{build.tags[0]}")
        except NotFoundError:
            before = None
        if before is not None and before.recipe == key and before.snapshot_id \
                and not spec.force and await self._snapshot_ready(before):
            build.log(f"Template {build.name}: served from the cache (unchanged since "
                      f"{before.built_at:%Y-%m-%d %H:%M:%S} UTC)")
            await self._point(build.name, build.tags, before)
            return
        build.log(f"Base {origin}: starting a sandbox of it")
        rec = await c.sandboxes.create(create.model_copy(update={
            "memory_mb": build.memory_mb, "cpus": build.cpus,
            "timeout": self.settings.limits.build_seconds}), who=who)
        sid = rec.sandbox_id
        try:
            state = _State()
            await self._exec(build, sid, steps.ENSURE_USER, "root", "/", {}, 0, deadline)
            for n, step in enumerate(spec.steps, 1):
                build.log(f"[{n}/{len(spec.steps)}] {step.kind} {' '.join(step.args)[:300]}")
                await self._step(build, sid, step, n, state, deadline)
            if spec.start_cmd:
                build.log(f"Start command: {spec.start_cmd}")
                await c.commands.start(sid, ExecRequest(
                    cmd=spec.start_cmd, background=True, timeout=0, stdin="",
                    user=state.user, cwd=state.cwd, env=state.env or None), who=who)
            if spec.ready_cmd:
                await self._wait_ready(build, sid, spec.ready_cmd, state, deadline)
            build.log("Snapshotting the sandbox")
            snap = await c.sandboxes.snapshot(sid, memory=True, who=who)
            snap = await c.snapshots.wait(snap.snapshot_id, max(60.0, deadline -
                                                                time.monotonic()), who=who)
            if snap.state != SnapshotState.READY:
                raise BuildError(f"the template's snapshot is {snap.state.value}")
        finally:
            with contextlib.suppress(SandlotError):
                await c.sandboxes.kill(sid, who=who)
        base = await self.templates.current(rec.template or "")
        info = base.model_copy(update={
            "name": build.name, "owner": build.owner, "env": {**base.env, **state.env},
            "workdir": state.cwd, "user": None if state.user == "root" else state.user,
            "image": origin, "start_cmd": spec.start_cmd, "ready_cmd": spec.ready_cmd,
            "snapshot_id": snap.snapshot_id, "recipe": key, "built_at": now(),
            "memory_mb": build.memory_mb, "cpus": build.cpus, "build_id": build.build_id})
        await self._point(build.name, build.tags, info)

    async def _snapshot_ready(self, info: TemplateInfo) -> bool:
        try:
            snap = await self.core.snapshots.get(info.snapshot_id, tenant_of(info.owner))
        except NotFoundError:
            return False
        return snap.state == SnapshotState.READY

    async def _step(self, build: Build, sid: str, step: steps.Step, n: int, state: _State,
                    deadline: float) -> None:
        a = step.args
        if step.kind == "RUN":
            await self._exec(build, sid, a[0], a[1] if len(a) > 1 and a[1] else state.user,
                             state.cwd, state.env, n, deadline)
        elif step.kind == "ENV":
            state.env.update(zip(a[::2], a[1::2], strict=True))
        elif step.kind == "USER":
            state.user = a[0].split(":", 1)[0]
        elif step.kind == "WORKDIR":
            path = posixpath.join(state.cwd, a[0])
            await self._exec(build, sid, f"mkdir -p {shlex.quote(path)} && chown "
                             f"{shlex.quote(state.user)} {shlex.quote(path)}", "root", "/", {},
                             n, deadline)
            state.cwd = path
        elif step.kind == "COPY":
            await self._copy(build, sid, step, n, state, deadline)

    async def _copy(self, build: Build, sid: str, step: steps.Step, n: int, state: _State,
                    deadline: float) -> None:
        """A COPY: the uploaded files matching its source, written into the sandbox (a
        folder's contents under the destination, as Docker copies), owned by its user (the
        current one by default), with its mode."""
        a = step.args
        root = self._upload_dir(build.owner, step.files_hash or "")
        src = a[0].removeprefix("./").rstrip("/") or "."
        matches = sorted(root.glob(src)) if any(ch in src for ch in "*?[") else [root / src]
        matches = [m for m in matches if m.exists() or m.is_symlink()]
        if not matches:
            raise BuildStepError(f"step {n} (COPY): {a[0]!r} matched no uploaded file")
        dest = posixpath.join(state.cwd, a[1])
        into = a[1].endswith("/") or len(matches) > 1 or matches[0].is_dir()
        owner = (a[2] if len(a) > 2 and a[2] else state.user).split(":", 1)[0]
        written: list[str] = []
        runnable: list[str] = []
        for m in matches:
            files = sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m]
            for f in files:
                rel = f.relative_to(m) if m.is_dir() else Path(m.name)
                target = posixpath.join(dest, str(rel)) if into else dest
                await self.core.files.write(sid, target, _chunks(f), user=owner,
                                            who=tenant_of(build.owner))
                written.append(target)
                if f.stat().st_mode & 0o111:
                    runnable.append(target)
        if len(a) > 3 and a[3]:
            await self._exec(build, sid, f"chmod {a[3]} " + " ".join(
                shlex.quote(w) for w in written), "root", "/", {}, n, deadline)
        elif runnable:  # as Docker copies: an executable file stays one
            await self._exec(build, sid, "chmod a+x " + " ".join(
                shlex.quote(w) for w in runnable), "root", "/", {}, n, deadline)
        build.log(f"copied {len(written)} file(s) to {dest}")

    async def _exec(self, build: Build, sid: str, cmd: str, user: str, cwd: str,
                    env: dict[str, str], n: int, deadline: float, quiet: bool = False
                    ) -> int:
        """Run a build command in the sandbox, its output in the logs; BuildStepError for a
        non-zero exit (unless `quiet`: the exit code)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise BuildStepError("the build ran past its time limit "
                                 f"({self.settings.limits.build_seconds} s)")
        tail: list[str] = []
        pending = ""
        code = None
        shell = f"if [ -x /bin/bash ]; then exec /bin/bash -c {shlex.quote(cmd)}; fi; " \
                f"exec /bin/sh -c {shlex.quote(cmd)}"
        try:
            async for event in self.core.commands.run(sid, ExecRequest(
                    cmd=shell, user=user, cwd=cwd, env=env or None, timeout=left, stdin=""),
                    who=tenant_of(build.owner)):
                if isinstance(event, Output):
                    pending += event.data.decode(errors="replace")
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        tail = (tail + [line])[-OUTPUT_TAIL:]
                        if not quiet:
                            build.log(line, "error" if event.stream == "stderr" else "info")
                elif isinstance(event, Exited):
                    code = event.exit_code
        except CommandTimeoutError:
            raise BuildStepError(f"step {n} ran past the build's time limit") from None
        if pending:
            tail = (tail + [pending])[-OUTPUT_TAIL:]
            if not quiet:
                build.log(pending)
        if code and not quiet:
            if n:
                build.reason_step = str(n)
            what = f"step {n}" if n else "making the user account"
            raise BuildStepError(f"{what} failed (exit {code}): {cmd[:200]}\n"
                                 + "\n".join(tail).strip())
        return code or 0

    async def _wait_ready(self, build: Build, sid: str, ready_cmd: str, state: _State,
                          deadline: float) -> None:
        build.log(f"Waiting for the ready command: {ready_cmd}")
        while True:
            if await self._exec(build, sid, ready_cmd, state.user, state.cwd, state.env, 0,
                                deadline, quiet=True) == 0:
                build.log("The ready command succeeded")
                return
            if time.monotonic() > deadline:
                raise BuildStepError(f"the ready command {ready_cmd!r} did not succeed within "
                                     "the build's time limit")
            await asyncio.sleep(1)

    async def _registry_login(self, build: Build, login: RegistryLogin | ecr.Keys
                              ) -> RegistryLogin:
        """The login a build pulls its base image with: an AWS access key's is the token
        ECR's API gives it now (images/ecr.py), for the image's registry."""
        if not isinstance(login, ecr.Keys):
            return login
        build.log(f"Registry login: asking ECR (region {login.region}) for a token")
        return RegistryLogin(*await ecr.login(login, self.settings.ecr_endpoint))

    async def _drop_snapshot(self, info: TemplateInfo) -> None:
        assert info.snapshot_id
        with contextlib.suppress(SandlotError):
            await self.core.snapshots.delete(info.snapshot_id, who=tenant_of(info.owner))


@dataclass
class _State:
    """Where the steps are: the user and folder the next one runs as and in, the envs."""

    user: str = steps.DEFAULT_USER
    cwd: str = steps.DEFAULT_WORKDIR
    env: dict[str, str] = field(default_factory=dict)


def _check_owner(info: TemplateInfo, who: Principal, operator: str) -> None:
    """PermissionDeniedError unless `who` may change template `info` (its owner's alone; the
    operator's are changed on the server: `operator` says how)."""
    if owned(info, who):
        return
    if info.owner is None:
        raise PermissionDeniedError(f"{info.name!r} is a template of this server's operator; "
                                    f"{operator}")
    raise PermissionDeniedError(f"template {info.name!r} is another team's public template; "
                                "only its owner changes it")


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, 1 << 20):
            yield chunk


def _unpack(f, target: Path, limit: int) -> None:
    """A tar (gzipped or not) into `target`, only regular files, folders and links inside
    it (tarfile's "data" filter), at most `limit` bytes unpacked (a small gzip can hold a
    huge file); InvalidArgumentError if it is not one, PayloadTooLargeError if larger."""
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        try:
            with tarfile.open(fileobj=f, mode="r:*") as tar:
                members, size = [], 0
                for member in tar:
                    size += member.size
                    if size > limit:
                        raise PayloadTooLargeError(
                            f"an upload is at most {limit} bytes unpacked")
                    members.append(member)
                tar.extractall(tmp, members=members, filter="data")
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            raise InvalidArgumentError(f"the upload is not a tar archive: {e}") from None
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_symlink() and p.is_file())


def _keep_newest(tenant_dir: Path, limit: int, newest: Path) -> None:
    """Drop a tenant's oldest uploads (by when they came) until the rest fit in `limit`
    bytes; the one that just came always stays (its own size is bounded on its own)."""
    uploads = sorted((p for p in tenant_dir.iterdir() if p.is_dir() and "." not in p.name),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for upload in uploads:
        size = _tree_bytes(upload)
        if upload != newest and total + size > limit:
            shutil.rmtree(upload, ignore_errors=True)
        else:
            total += size


__all__ = ["TemplateBuilds", "BuildSpec", "Build", "template_name"]
