"""Dockerfile builds with buildah (no daemon: `bud --isolation chroot`, storage of its own
under the images dir), each step cached (`--layers`): a rebuild runs from the first changed
step.

Base images (`FROM`) are pulled by sandlot's own pull (oci.py: insecure registries, credentials,
pinned by digest) into OCI layouts and the Dockerfile is given to buildah with `FROM oci:...`,
so buildah itself never reaches a registry. The result is pushed to an OCI layout, named by its
image id, which `images.pipeline.build_image_template` turns into a template.

Supported: FROM (also multi-stage and `scratch`), RUN, COPY and ADD from the context, ENV, ARG,
WORKDIR, USER, ENTRYPOINT, CMD; every other instruction is passed to buildah, which may keep it
in the image config, but sandlot does nothing with it: a warning says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import BuildError, BuildStepError, ImageError
from sandlot.images import oci

DRIVER_ENV = "SANDLOT_BUILDAH_DRIVER"  # overlay (default: layers as diffs) or vfs (copies)
SUPPORTED = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "ENTRYPOINT", "CMD"}
MAX_DOCKERFILE = 1 << 20
OUTPUT_TAIL = 60  # lines of a failed step's output kept in its error
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_STEP = re.compile(r"^STEP (\d+)/(\d+): (.*)$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int  # 1-based, where it starts


@dataclass
class Prepared:
    """A Dockerfile ready for buildah: its text with FROMs rewritten, and warnings."""

    text: str
    warnings: list[str] = field(default_factory=list)
    bases: list[str] = field(default_factory=list)  # the pinned references it builds on


def parse(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined; comments and blank lines dropped."""
    out: list[Instruction] = []
    current: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if not current:
            start = number
        if line.endswith("\\"):
            current.append(line[:-1])
            continue
        current.append(line)
        joined = " ".join(p.strip() for p in current if p.strip())
        current = []
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    if current:
        raise ImageError(f"Dockerfile line {start}: a continuation runs past the end")
    if not out or out[0].keyword not in ("FROM", "ARG"):
        raise ImageError("a Dockerfile starts with FROM (after any ARG)")
    return out


def _substitute(text: str, values: dict[str, str], line: int) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in values:
            return values[name]
        if m.group(2) is not None:
            return m.group(2)
        raise ImageError(f"Dockerfile line {line}: ${name} has no value (give it an ARG "
                         "default or a build arg)")
    return _VAR.sub(one, text)


def prepare(text: str, build_args: dict[str, str],
            pull: Callable[[str], Path]) -> Prepared:
    """Rewrite every FROM of an image to `FROM oci:<layout>:img`, `pull(reference)` giving the
    layout; FROM scratch and FROM of an earlier stage stay. Warn about what sandlot ignores."""
    if len(text) > MAX_DOCKERFILE:
        raise ImageError(f"the Dockerfile is over {MAX_DOCKERFILE} bytes")
    instructions = parse(text)
    global_args: dict[str, str] = {}
    stages: set[str] = set()
    prepared = Prepared(text="")
    lines: list[str] = []
    seen_from = False
    for ins in instructions:
        if ins.keyword == "ARG" and not seen_from:
            name, _, default = ins.args.partition("=")
            name = name.strip()
            if name in build_args:
                global_args[name] = build_args[name]
            elif default:
                global_args[name] = default.strip().strip('"')
        if ins.keyword == "FROM":
            seen_from = True
            lines.append(_rewrite_from(ins, global_args, stages, pull, prepared))
            continue
        if ins.keyword not in SUPPORTED:
            prepared.warnings.append(f"Dockerfile line {ins.line}: {ins.keyword} is ignored "
                                     "by sandlot (a sandbox does not use it)")
        lines.append(f"{ins.keyword} {ins.args}")
    prepared.text = "\n".join(lines) + "\n"
    return prepared


def _rewrite_from(ins: Instruction, args: dict[str, str], stages: set[str],
                  pull: Callable[[str], Path], prepared: Prepared) -> str:
    words = _substitute(ins.args, args, ins.line).split()
    flags = [w for w in words if w.startswith("--")]
    rest = [w for w in words if not w.startswith("--")]
    if not rest or len(rest) not in (1, 3) or (len(rest) == 3 and rest[1].lower() != "as"):
        raise ImageError(f"Dockerfile line {ins.line}: FROM [--platform=...] IMAGE [AS NAME]")
    if any(not f.startswith("--platform=") for f in flags):
        raise ImageError(f"Dockerfile line {ins.line}: FROM takes only --platform")
    image = rest[0]
    if len(rest) == 3:
        stages.add(rest[2].lower())
    if image == "scratch" or image.lower() in stages - ({rest[2].lower()} if len(rest) == 3
                                                         else set()):
        return "FROM " + " ".join(rest)
    layout = pull(image)
    prepared.bases.append(image)
    return "FROM " + " ".join([f"oci:{layout}:{oci.TAG}", *rest[1:]])


@dataclass(frozen=True)
class Buildah:
    """buildah with storage of its own under `root` (no daemon): overlay, or vfs where
    overlay mounts are not allowed (`SANDLOT_BUILDAH_DRIVER=vfs`: each step a full copy)."""

    root: Path
    driver: str = "overlay"  # Settings.buildah_driver

    def _base(self) -> list[str]:
        if shutil.which("buildah") is None:
            raise BuildError("buildah is not installed (apt-get install buildah)")
        if self.driver not in ("overlay", "vfs"):
            raise BuildError(f"{DRIVER_ENV}={self.driver!r}: give overlay or vfs")
        return ["buildah", "--root", str(self.root / f"storage-{self.driver}"), "--runroot",
                str(self.root / f"run-{self.driver}"), "--storage-driver", self.driver]

    def build(self, dockerfile: str, context: Path, build_args: dict[str, str],
              step: Callable[[str], None]) -> str:
        """Build; the image id (``sha256:...``). BuildStepError names a failed step and ends
        with its output."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "Dockerfile"
            path.write_text(dockerfile)
            iid = Path(tmp) / "iid"
            cmd = [*self._base(), "bud", "--isolation", "chroot", "--layers",
                   "--pull-never", "--format", "oci", "--iidfile", str(iid), "-f", str(path)]
            for key, value in build_args.items():
                cmd += ["--build-arg", f"{key}={value}"]
            cmd.append(str(context))
            tail: deque[str] = deque(maxlen=OUTPUT_TAIL)
            current = ""
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                m = _STEP.match(line)
                if m:
                    current = line
                    tail.clear()
                    step(f"step {m.group(1)}/{m.group(2)}: {m.group(3)[:80]}")
                elif "Using cache" in line:
                    step(f"{current[:90]} (cached)")
                else:
                    tail.append(line)
            code = proc.wait()
            if code:
                output = "\n".join(tail).strip()
                raise BuildStepError(f"Dockerfile {current or 'build'} failed (exit {code}):"
                                     f"\n{output}")
            return iid.read_text().strip()

    def push(self, image_id: str, layout: Path) -> Path:
        """The image as an OCI layout (tag `img`); once per image id."""
        if (layout / "index.json").exists():
            return layout
        layout.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=layout.name + ".", dir=layout.parent))
        try:
            proc = subprocess.run([*self._base(), "push", "--quiet", "--disable-compression",
                                   image_id,
                                   f"oci:{tmp}:{oci.TAG}"], capture_output=True, text=True)
            if proc.returncode:
                raise BuildError(f"buildah push failed: {(proc.stderr or proc.stdout)[-1500:]}")
            tmp.replace(layout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return layout
