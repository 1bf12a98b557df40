"""Template specs: what goes into a guest image, and the content hash that caches its build."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandlot.errors import InvalidArgumentError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
IMAGE_TEMPLATE_PREFIX = "image-"  # the templates creates from an OCI image make
# Bump when the build steps change in a way the spec does not show.
BUILDER_VERSION = "7"  # 7: root filesystems of `disk_mb` again (6 fitted them to their files)
BASE_PACKAGES = [
    "python3", "python3-pip", "python3-venv", "bash", "coreutils", "procps", "iproute2",
    "ca-certificates", "curl", "sudo", "less", "kmod",
]


class TemplateSpec(BaseModel):
    """A template: Debian bookworm plus packages, files, env, a workdir and build commands."""

    model_config = ConfigDict(extra="forbid")

    name: str
    packages: list[str] = Field(default_factory=list)
    pip: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict, description="guest path -> host path")
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    run: list[str] = Field(default_factory=list)
    memory_mb: int = Field(512, ge=128, le=16384)
    cpus: int = Field(1, ge=1, le=4)
    # its root filesystem (sparse on the host): a sandbox's disk unless its create asks for
    # more (`disk_mb`, grown when it starts: runtime/qemu.py), so at the default quota no
    # restore grows anything
    disk_mb: int = Field(2048, ge=512, le=65536)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("template names are lowercase letters, digits, '.', '_' or '-'")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for guest in v:
            if not guest.startswith("/"):
                raise ValueError(f"guest path {guest!r} must be absolute")
        return v

    @classmethod
    def load(cls, path: Path) -> TemplateSpec:
        """Load a spec from TOML; relative host paths in `files` resolve against its folder."""
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidArgumentError(f"cannot read template spec {path}: {e}") from e
        data.setdefault("name", path.stem)
        files = data.get("files", {})
        data["files"] = {g: str((path.parent / h).resolve()) for g, h in files.items()}
        try:
            return cls.model_validate(data)
        except ValueError as e:
            raise InvalidArgumentError(f"invalid template spec {path}: {e}") from e

    def content_hash(self, extra: bytes = b"") -> str:
        h = hashlib.sha256()
        body = self.model_dump(exclude={"name"})
        h.update(json.dumps(body, sort_keys=True).encode())
        h.update(BUILDER_VERSION.encode())
        for guest, host in sorted(self.files.items()):
            try:
                h.update(guest.encode() + Path(host).read_bytes())
            except OSError as e:
                raise InvalidArgumentError(f"template file {host}: {e.strerror}") from e
        h.update(extra)
        return h.hexdigest()[:16]


# What an agent expects of E2B's base template besides BASE_PACKAGES: `python`, git, node and
# npm, a compiler toolchain and the usual fetch and archive tools.
DEFAULT_TEMPLATE_PACKAGES = [
    "python-is-python3", "git", "nodejs", "npm", "build-essential", "jq", "unzip", "zip",
    "wget", "xz-utils",
]
# Debian marks its Python externally managed, so a plain `pip install` fails; E2B's image (like
# the official Python images) has no marker, so pip installs without flags there.
LIFT_PIP_RESTRICTION = "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED"


def base_spec() -> TemplateSpec:
    """The default template, `base`: E2B's base image as an agent sees it."""
    return TemplateSpec(name="base", packages=DEFAULT_TEMPLATE_PACKAGES,
                        run=[LIFT_PIP_RESTRICTION])
