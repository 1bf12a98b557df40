"""OCI images: parse a reference, resolve it to a digest, pull it into an OCI layout (skopeo),
read its config, unpack its filesystem (umoci). No registry client of our own.

A registry is reached over TLS unless it is named in `SANDLOT_INSECURE_REGISTRIES`
(``host:port,...``) or given as insecure by the caller. Credentials are skopeo's: the usual
Docker and containers auth files (``~/.docker/config.json``, ``$XDG_RUNTIME_DIR/containers/
auth.json``), `SANDLOT_REGISTRY_AUTH_FILE`, or ``user:password`` given by the caller.

Which registries may be reached at all is `egress.Policy` (`SANDLOT_REGISTRIES`): checked
before skopeo runs, and on every connection skopeo opens (`egress.Proxy`). A pull from a
registry the operator did not name that is refused or fails answers one error (`UNIFORM`),
whatever the reason: a closed port, a service that is not a registry, a policy refusal.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import BuildError, ImageError, ImageNotFoundError
from sandlot.images import egress

log = logging.getLogger(__name__)

INSECURE_ENV = "SANDLOT_INSECURE_REGISTRIES"
TAG = "img"  # the one tag in each layout we write
DIGEST_RE = re.compile(r"^sha256:[a-f0-9]{64}$")
# The reference grammar of the distribution spec: [host[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
REFERENCE_RE = re.compile(
    rf"^(?:(?P<host>{_HOST})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$")
NOT_FOUND = ("manifest unknown", "name unknown", "not found", "repository does not exist",
             "requested access to the resource is denied")
SKOPEO_TIMEOUT = "10m"
UNIFORM = ("cannot pull image {ref!r}: it was not found, its registry refused it or did not "
           "answer, or this server may not reach that registry (" + egress.ALLOW_ENV + ")")


@dataclass(frozen=True)
class Reference:
    """An image reference as the user gave it, split. `host` is None for the default
    registry (Docker Hub): skopeo fills it in, and it is never reached over plain HTTP."""

    text: str
    host: str | None
    path: str
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> str:
        """The reference without its tag, at `digest` (or its own)."""
        base = f"{self.host}/{self.path}" if self.host else self.path
        return f"{base}@{self.digest}"

    def at(self, digest: str) -> Reference:
        return Reference(self.text, self.host, self.path, self.tag, digest)


def parse_reference(text: str) -> Reference:
    """Split an image reference (``python:3.12-slim``, ``host:5000/team/app@sha256:...``);
    ImageError if it is not one."""
    text = (text or "").strip()
    if text.startswith("docker://"):
        text = text.removeprefix("docker://")
    m = REFERENCE_RE.match(text) if len(text) <= 512 else None
    if m is None:
        raise ImageError(f"invalid image reference {text!r}: expected [registry/]name[:tag]"
                         "[@sha256:digest], lowercase, e.g. python:3.12-slim")
    host = m.group("host")
    path = m.group("path")
    if host is not None and "." not in host and ":" not in host and host != "localhost":
        if not re.fullmatch(_COMPONENT, host):
            raise ImageError(f"invalid image reference {text!r}: repository names are "
                             "lowercase")
        path, host = f"{host}/{path}", None  # `team/app`: a Docker Hub path, not a host
    return Reference(text, host, path, m.group("tag"), m.group("digest"))


@dataclass(frozen=True)
class Access:
    """How to reach registries: which ones are plain HTTP, and credentials."""

    insecure: frozenset[str] = frozenset()
    creds: str | None = None  # user:password
    auth_file: str | None = None
    policy: egress.Policy | None = None  # None: the default, plus the insecure registries

    @classmethod
    def of(cls, insecure: Iterable[str] = (), creds: str | None = None,
           auth_file: str | None = None, registries: str | None = None) -> Access:
        """The operator's access: the `insecure` registries, and pulls limited by
        `registries` (SANDLOT_REGISTRIES as given, egress.Policy.parse) and those."""
        names = frozenset(h.strip() for h in insecure if h.strip())
        return cls(names, creds, auth_file or None, egress.Policy.parse(registries, names))

    @property
    def registries(self) -> egress.Policy:
        """Where pulls may go."""
        if self.policy is not None:
            return self.policy
        return egress.Policy(frozenset(h.lower() for h in self.insecure))

    def named(self, ref: Reference) -> bool:
        """Whether the operator named `ref`'s registry (its errors are then told in full)."""
        try:
            host, port = egress.split_host(ref.host or egress.DOCKER_HUB)
        except egress.Refused:
            return False
        return self.registries.names(host, port)

    def is_insecure(self, ref: Reference) -> bool:
        return ref.host is not None and ref.host in self.insecure

    def flags(self, ref: Reference, side: str) -> list[str]:
        """skopeo flags for reaching `ref`'s registry; `side` is ``src`` or ``dest``, or ""
        for commands with one image (inspect)."""
        prefix = f"--{side}-" if side else "--"
        out = [f"{prefix}tls-verify={'false' if self.is_insecure(ref) else 'true'}"]
        if self.creds:
            out.append(f"{prefix}creds={self.creds}")
        if self.auth_file:
            out.append(f"{prefix}authfile={self.auth_file}")
        return out


@dataclass(frozen=True)
class ImageConfig:
    """What an image's config says about running commands in it."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def _skopeo(args: list[str], ref: Reference, access: Access) -> bytes:
    """skopeo's output, as bytes (a manifest's digest is of its exact bytes). The registry
    is checked against the access's policy first, and skopeo reaches it through the policy's
    proxy; a registry the operator did not name fails with `UNIFORM` alone."""
    policy = access.registries
    try:
        policy.check(ref.host)
    except egress.Refused as e:
        log.info("image %s refused: %s", ref.text, e)
        raise ImageError(UNIFORM.format(ref=ref.text)) from None
    if shutil.which("skopeo") is None:
        raise BuildError("skopeo is not installed (apt-get install skopeo)")
    named = access.named(ref)
    proc = egress.run(["skopeo", "--command-timeout", SKOPEO_TIMEOUT, *args], policy,
                      isolate=not named)
    if proc.returncode == 0:
        return proc.stdout
    err = (proc.stderr or proc.stdout).decode(errors="replace").strip()
    msg = err.rsplit('msg="', 1)[-1].rstrip('"').replace('\\"', '"')[-1500:]
    if not named:
        log.info("image %s: skopeo failed: %s", ref.text, msg)
        raise ImageError(UNIFORM.format(ref=ref.text))
    low = msg.lower()
    if any(s in low for s in NOT_FOUND):
        raise ImageNotFoundError(f"image {ref.text!r} not found in its registry (or access "
                                 f"denied without credentials): {msg}")
    if "http response to https client" in low:
        raise ImageError(f"registry of {ref.text!r} speaks plain HTTP: name it in "
                         f"{INSECURE_ENV} (host:port) to allow that: {msg}")
    if "unauthorized" in low or "authentication required" in low or "denied" in low:
        raise ImageError(f"registry refused {ref.text!r}: credentials needed or wrong: {msg}")
    raise ImageError(f"cannot fetch image {ref.text!r}: {msg}")


def resolve(ref: Reference, access: Access, verify: bool = False) -> Reference:
    """`ref` pinned to the digest its tag points at now (unchanged if already pinned, and
    then not looked up unless `verify`: the registry is asked for it with `access`)."""
    if ref.digest and not verify:
        return ref
    target = f"docker://{ref.pinned if ref.digest else ref.text}"
    # The manifest (or index) as the registry serves it: its digest is the image's.
    out = _skopeo(["inspect", "--raw", *access.flags(ref, ""), target], ref, access)
    digest = "sha256:" + hashlib.sha256(out).hexdigest()
    if ref.digest and digest != ref.digest:
        raise ImageError(f"image {ref.text!r}: its registry served another digest, {digest}")
    return ref.at(digest)


@contextlib.contextmanager
def login_file(ref: Reference, username: str, password: str) -> Iterator[str]:
    """An auth file (containers-auth.json, mode 0600) holding one login for `ref`'s
    registry, for the length of the block: credentials given with one pull are never put on
    a command line, and are gone after it."""
    host = ref.host or "docker.io"
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    fd, path = tempfile.mkstemp(prefix="sandlot-login-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {host: {"auth": auth}}}, f)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def pull(ref: Reference, layout: Path, access: Access) -> Path:
    """Copy the pinned image into the OCI layout `layout` (tag `img`), for this host's
    platform; once (a layout that is complete is kept)."""
    if not ref.digest:
        raise ValueError("pull a pinned reference (resolve it first)")
    if (layout / "index.json").exists():
        return layout
    layout.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=layout.name + ".", dir=layout.parent))
    try:
        _skopeo(["copy", "--quiet", *access.flags(ref, "src"), f"docker://{ref.pinned}",
                 f"oci:{tmp}:{TAG}"], ref, access)
        tmp.replace(layout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layout


def read_config(layout: Path) -> ImageConfig:
    """The image config of the layout's `img` (or only) manifest."""
    try:
        index = json.loads((layout / "index.json").read_text())
        manifests = index.get("manifests", [])
        chosen = next((m for m in manifests
                       if m.get("annotations", {}).get("org.opencontainers.image.ref.name")
                       == TAG), manifests[0] if manifests else None)
        if chosen is None:
            raise ImageError(f"OCI layout {layout} has no image")
        manifest = json.loads(_blob(layout, chosen["digest"]).read_text())
        config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    except (OSError, KeyError, ValueError) as e:
        raise ImageError(f"cannot read the image config in {layout}: {e}") from e
    c = config.get("config") or {}
    env = {}
    for item in c.get("Env") or []:
        key, _, value = str(item).partition("=")
        if key:
            env[key] = value
    return ImageConfig(env=env, workdir=c.get("WorkingDir") or None,
                       user=c.get("User") or None,
                       entrypoint=[str(a) for a in c.get("Entrypoint") or []],
                       cmd=[str(a) for a in c.get("Cmd") or []])


def _blob(layout: Path, digest: str) -> Path:
    if not DIGEST_RE.match(digest):
        raise ImageError(f"unsupported digest {digest!r} in {layout}")
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def config_digest(layout: Path) -> str:
    """The digest of the layout's manifest (what identifies the image)."""
    index = json.loads((layout / "index.json").read_text())
    return str(index["manifests"][0]["digest"])


def unpack(layout: Path, bundle: Path) -> Path:
    """The image's filesystem, its layers applied in order (whiteouts honoured): `bundle`/
    rootfs, owned as in the image (run as root)."""
    if shutil.which("umoci") is None:
        raise BuildError("umoci is not installed (apt-get install umoci)")
    proc = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{TAG}", str(bundle)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise ImageError(f"cannot unpack the image: {(proc.stderr or proc.stdout)[-1500:]}")
    return bundle / "rootfs"


__all__ = ["Access", "ImageConfig", "Reference", "parse_reference", "resolve", "pull",
           "read_config", "unpack", "config_digest"]
