"""A single-stage Dockerfile as template build steps (images/steps.py) for sandlot's
builder (core/builds.py): the steps run in a sandbox of the FROM (a sandlot template or an
image), never with buildah on the host.

FROM (one stage) is the base; RUN, ENV, ARG, WORKDIR, USER and COPY (from the build context,
uploaded as one files hash) become steps, run as root in ``/`` as Docker runs them. CMD,
ENTRYPOINT, EXPOSE, LABEL, MAINTAINER, STOPSIGNAL, HEALTHCHECK and VOLUME describe a
container, not its files: they are skipped (a warning says so). Anything else (ADD, SHELL,
ONBUILD, COPY --from, RUN --mount, a second FROM) is refused, naming its line.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from sandlot.errors import ImageError, InvalidArgumentError
from sandlot.images import dockerfile, steps

MAX_DOCKERFILE = 1 << 20
SKIPPED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK",
           "VOLUME"}
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class Plan:
    """What a Dockerfile builds: its base (FROM, as written) and steps."""

    base: str
    steps: list[steps.Step]
    warnings: list[str] = field(default_factory=list)


def _sub(text: str, values: dict[str, str]) -> str:
    """Docker's ``$VAR``/``${VAR}``/``${VAR:-default}`` from ARG and ENV values; unknown
    variables become empty (as Docker does)."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in values:
            return values[name]
        return m.group(2) or ""
    return _VAR.sub(one, text)


def _words(args: str, line: int, what: str) -> list[str]:
    """An instruction's arguments: the JSON (exec) form or shell words."""
    if args.startswith("["):
        try:
            words = json.loads(args)
        except ValueError:
            words = None
        if isinstance(words, list) and all(isinstance(w, str) for w in words):
            return words
    try:
        return shlex.split(args)
    except ValueError as e:
        raise InvalidArgumentError(f"Dockerfile line {line}: {what}: {e}") from None


def _pairs(args: str, line: int) -> list[tuple[str, str]]:
    """ENV/ARG's ``K=V K2="v 2"``, or the old ``K V`` form."""
    words = _words(args, line, "name=value")
    if words and "=" not in words[0]:
        key, _, value = args.partition(" ")
        return [(key, value.strip())]
    out = []
    for w in words:
        key, eq, value = w.partition("=")
        out.append((key, value) if eq else (key, ""))
    return out


def convert(text: str, files_hash: str | None) -> Plan:
    """The plan of a Dockerfile (its COPYs take their files from the upload `files_hash`);
    InvalidArgumentError names the line sandlot cannot build."""
    if len(text.encode()) > MAX_DOCKERFILE:
        raise InvalidArgumentError(f"the Dockerfile is over {MAX_DOCKERFILE} bytes")
    try:
        instructions = dockerfile.parse(text)
    except ImageError as e:
        raise InvalidArgumentError(e.message) from None
    values: dict[str, str] = {}  # ARG and ENV values, for substitution
    args: dict[str, str] = {}  # ARG values, the environment of RUN
    base: str | None = None
    plan = Plan(base="", steps=[steps.Step("USER", ("root",)), steps.Step("WORKDIR", ("/",))])
    for ins in instructions:
        where = f"Dockerfile line {ins.line}"
        kw = ins.keyword
        if kw == "FROM":
            if base is not None:
                raise InvalidArgumentError(f"{where}: a second FROM; sandlot builds "
                                           "single-stage Dockerfiles")
            words = _sub(ins.args, values).split()
            flags = [w for w in words if w.startswith("--")]
            rest = [w for w in words if not w.startswith("--")]
            if any(not f.startswith("--platform=") for f in flags) or len(rest) not in (1, 3) \
                    or (len(rest) == 3 and rest[1].lower() != "as"):
                raise InvalidArgumentError(f"{where}: FROM [--platform=...] IMAGE [AS NAME]")
            base = rest[0]
            continue
        if kw == "ARG":
            for key, value in _pairs(ins.args, ins.line):
                if not steps.ENV_KEY_RE.fullmatch(key):
                    raise InvalidArgumentError(f"{where}: invalid ARG name {key[:40]!r}")
                if key not in values or value:
                    values[key] = args[key] = _sub(value, values)
            continue
        if base is None:
            raise InvalidArgumentError(f"{where}: {kw} before FROM")
        if kw in SKIPPED:
            plan.warnings.append(f"{where}: {kw} is skipped (a sandbox does not use it)")
            continue
        if kw == "RUN":
            if ins.args.startswith("--"):
                raise InvalidArgumentError(f"{where}: RUN flags ({ins.args.split()[0]}) are "
                                           "not supported")
            cmd = shlex.join(_words(ins.args, ins.line, "RUN")) \
                if ins.args.startswith("[") else ins.args
            if args:
                cmd = "".join(f"export {k}={shlex.quote(v)}; " for k, v in args.items()) + cmd
            plan.steps.append(steps.Step("RUN", (cmd,)))
        elif kw == "ENV":
            flat: list[str] = []
            for key, value in _pairs(ins.args, ins.line):
                value = _sub(value, values)
                values[key] = value
                flat += [key, value]
            plan.steps.append(steps.Step("ENV", tuple(flat)))
        elif kw in ("WORKDIR", "USER"):
            plan.steps.append(steps.Step(kw, (_sub(ins.args, values).strip(),)))
        elif kw == "COPY":
            plan.steps += _copy(_words(_sub(ins.args, values), ins.line, "COPY"), where,
                                files_hash)
        else:
            raise InvalidArgumentError(f"{where}: {kw} is not supported by sandlot's builder "
                                       "(RUN, COPY, ENV, ARG, WORKDIR, USER)")
    if base is None:
        raise InvalidArgumentError("the Dockerfile has no FROM")
    plan.base = base
    if len(plan.steps) > steps.MAX_STEPS:
        raise InvalidArgumentError(f"the Dockerfile makes {len(plan.steps)} steps; at most "
                                   f"{steps.MAX_STEPS}")
    for n, step in enumerate(plan.steps, 1):
        try:
            steps._check(step, n)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"Dockerfile: {e.message}") from None
    return plan


def _copy(words: list[str], where: str, files_hash: str | None) -> list[steps.Step]:
    owner = mode = ""
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0).partition("=")
        if flag == "--chown":
            owner = value
        elif flag == "--chmod":
            mode = value
        else:
            raise InvalidArgumentError(f"{where}: COPY {flag} is not supported")
    if len(words) < 2:
        raise InvalidArgumentError(f"{where}: COPY SOURCE... DEST")
    *sources, dest = words
    if len(sources) > 1 and not dest.endswith("/"):
        raise InvalidArgumentError(f"{where}: COPY of several sources needs a DEST ending "
                                   "in /")
    if not files_hash:
        raise InvalidArgumentError(f"{where}: COPY needs a build context")
    for src in sources:
        parts = src.replace("\\", "/").split("/")
        if src.startswith("/") or ".." in parts:
            raise InvalidArgumentError(f"{where}: COPY source {src[:80]!r} is outside the "
                                       "build context")
    # Docker's COPY makes root-owned files unless --chown says otherwise
    return [steps.Step("COPY", (src, dest, owner or "root", mode), files_hash)
            for src in sources]


__all__ = ["Plan", "convert"]
