"""The template index: template names (and E2B's tags) -> builds, this host's and the
deployment's, who may use each, and what a create from a template or an OCI image restores.
The builds themselves are images/pipeline.py's; their GC is images/gc.py's (what it keeps:
`builds_in_use`).

Layout under the images dir::

    builds/<hash>/             a build (images/pipeline.py)
    templates/<name>.json      TemplateInfo: name -> build hash
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import shutil
from pathlib import Path

from sandlot.config import Settings
from sandlot.core.db import MetadataStore, run_sync, with_store
from sandlot.core.models import TemplateInfo
from sandlot.core.sources import Source
from sandlot.core.tenancy import SYSTEM, Principal
from sandlot.errors import ImageError, InvalidStateError, NotFoundError
from sandlot.images import oci
from sandlot.images.pipeline import (
    image_of,
    image_template_current,
    image_template_name,
    pull_image_template,
    registry_access,
)
from sandlot.images.spec import IMAGE_TEMPLATE_PREFIX, NAME_RE
from sandlot.runtime.base import Runtime

log = logging.getLogger(__name__)
DEFAULT_TAG = "default"  # E2B's tag of a template's own build


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
            own = await self.db.get_template(base)  # a tag is as public as its template
            return TemplateInfo.model_validate(row.doc | {
                "public": bool(own and own.doc and own.doc.get("public"))})
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
        """The templates `who` lists: this host's, and those built through the API on any
        host of the deployment (as they are now); not another tenant's public ones."""
        infos = {i.name: i for i in self.list(SYSTEM)}
        for row in await self.db.templates() if self.db is not None else []:
            if ":" in row.name:
                continue  # a tag
            if row.doc is None:
                infos.pop(row.name, None)
            else:
                infos[row.name] = TemplateInfo.model_validate(row.doc)
        return [infos[n] for n in sorted(infos) if listed(infos[n], who)]

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
        every host of the deployment, in the metadata store. The template stays as public
        as it was (a new one, or another tenant's name: private); `set_public` changes that."""
        row = await self.db.get_template(info.name) if self.db is not None else None
        was = row.doc if row is not None and row.doc is not None else {}
        info = info.model_copy(update={"public": bool(was.get("owner") == info.owner
                                                      and was.get("public"))})
        if self.runtime is not None:
            await self.runtime.publish_template(image_of(info), info.model_dump(mode="json"))
        self._remember(info)
        if self.db is not None:
            await self.db.put_template(info.name, info.model_dump(mode="json"))

    async def set_public(self, info: TemplateInfo, public: bool) -> None:
        """Make a template built through the API (`info`, as `current` has it) public or
        private, for every host of the deployment."""
        if self.db is None:
            raise InvalidStateError("this server keeps no template records")
        info = info.model_copy(update={"public": public})
        await self.db.put_template(info.name, info.model_dump(mode="json"))
        self._remember(info)


def visible(info: TemplateInfo, who: Principal) -> bool:
    """Whether `who` may use a template: shared templates (the operator's) are every
    tenant's; a template a tenant built is its own, and every tenant's once it is public;
    the templates creates from an image make (by digest) are named only by admins (a tenant
    creates from the image reference, which is checked against its registry)."""
    if who.admin:
        return True
    if info.name.startswith(IMAGE_TEMPLATE_PREFIX) and info.image:
        return info.owner == who.tenant  # an image pulled with a tenant's own credentials
    return info.owner is None or info.owner == who.tenant or info.public


def listed(info: TemplateInfo, who: Principal) -> bool:
    """Whether `who`'s listings show a template: those it may use but another tenant's
    public ones (E2B lists a team's own templates)."""
    return visible(info, who) and (who.admin or info.owner in (None, who.tenant))


def owned(info: TemplateInfo, who: Principal) -> bool:
    """Whether `who` may build, tag, delete or update a template it may use: its
    tenant's own (an admin: any)."""
    return who.admin or (info.owner is not None and info.owner == who.tenant)


def builds_in_use(settings: Settings) -> set[str]:
    """The template builds something needs: a template points at it, or a snapshot (creating,
    uploading or ready) or a running sandbox of this data dir was made from it (their restores
    map its kernel, initramfs and root filesystem). An images dir shared by several data dirs
    must be collected from the one whose snapshots matter: the others' are not looked at."""
    keep = {t.hash for t in TemplateStore(settings).list()}
    if settings.db_path.exists() or settings.database_url:
        async def in_use(db) -> set:
            return ({d.get("build") or d.get("base")
                     for d in await db.snapshots(("creating", "uploading", "ready"))} |
                    {d.get("build") or d.get("base")
                     for d in await db.sandboxes(("starting", "running", "paused"))})

        keep |= run_sync(with_store(settings.database_url, settings.db_path, in_use))
    return keep


def list_templates(data_dir: Path | None = None) -> list[TemplateInfo]:
    return TemplateStore(Settings.from_env(data_dir)).list()


def remove_template(name: str, data_dir: Path | None = None) -> None:
    TemplateStore(Settings.from_env(data_dir)).remove(name)


__all__ = ["TemplateStore", "visible", "listed", "owned", "builds_in_use", "list_templates",
           "remove_template"]
