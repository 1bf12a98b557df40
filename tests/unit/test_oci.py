"""The pure parts of building from OCI images: references, insecure registries, Dockerfile
preparation, the containment of writes into an image's tree, the image's USER."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandlot.config import Settings
from sandlot.errors import ImageError
from sandlot.images import dockerfile, oci
from sandlot.images.imagefs import resolve_user
from sandlot.images.pipeline import registry_access
from sandlot.images.rootfs import inside

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "host", "path", "tag", "digest"), [
    ("python:3.12-slim", None, "python", "3.12-slim", None),
    ("python", None, "python", None, None),
    ("team/app:v1", None, "team/app", "v1", None),
    ("127.0.0.1:5000/sandlot-test/debian:latest", "127.0.0.1:5000", "sandlot-test/debian",
     "latest", None),
    ("localhost/app", "localhost", "app", None, None),
    (f"registry.example:443/a/b@{DIGEST}", "registry.example:443", "a/b", None, DIGEST),
    (f"docker://python:3@{DIGEST}", None, "python", "3", DIGEST),
])
def test_parse_reference(text, host, path, tag, digest) -> None:
    ref = oci.parse_reference(text)
    assert (ref.host, ref.path, ref.tag, ref.digest) == (host, path, tag, digest)


@pytest.mark.parametrize("text", ["", "Not A Reference!", "UPPER/case", "a:b:c",
                                  "python@sha256:short", "x" * 600, "a//b", "-leading"])
def test_bad_reference(text) -> None:
    with pytest.raises(ImageError, match="invalid image reference"):
        oci.parse_reference(text)


def test_pinned_and_insecure(monkeypatch) -> None:
    ref = oci.parse_reference("127.0.0.1:5000/app:1").at(DIGEST)
    assert ref.pinned == f"127.0.0.1:5000/app@{DIGEST}"
    monkeypatch.setenv(oci.INSECURE_ENV, "127.0.0.1:5000, other:1")
    access = registry_access(Settings.from_env())
    assert access.insecure == {"127.0.0.1:5000", "other:1"}
    access = oci.Access.of(access.insecure, creds="u:p")
    assert access.is_insecure(ref)
    assert access.flags(ref, "src") == ["--src-tls-verify=false", "--src-creds=u:p"]
    hub = oci.parse_reference("python")
    assert not access.is_insecure(hub)  # the default registry is never plain HTTP
    assert oci.Access().flags(ref, "") == ["--tls-verify=true"]


def test_dockerfile_prepare_rewrites_from() -> None:
    pulled: list[str] = []

    def pull(ref: str) -> Path:
        pulled.append(ref)
        return Path(f"/layouts/{len(pulled)}")

    text = """# syntax comment
ARG BASE=reg:5000/base:1
FROM ${BASE} AS build
RUN make \\
    all
FROM scratch AS empty
FROM build
COPY --from=build /out /out
HEALTHCHECK CMD true
FROM --platform=linux/amd64 other:2
"""
    prepared = dockerfile.prepare(text, {}, pull)
    assert pulled == ["reg:5000/base:1", "other:2"]
    lines = prepared.text.splitlines()
    assert lines[1] == "FROM oci:/layouts/1:img AS build"
    assert lines[2] == "RUN make all"
    assert "FROM scratch AS empty" in lines and "FROM build" in lines
    assert lines[-1] == "FROM oci:/layouts/2:img"
    assert len(prepared.warnings) == 1 and "HEALTHCHECK" in prepared.warnings[0]
    assert dockerfile.prepare(text, {"BASE": "mine:3"}, pull).text.splitlines()[1] == \
        "FROM oci:/layouts/3:img AS build"


@pytest.mark.parametrize(("text", "match"), [
    ("RUN true\n", "starts with FROM"),
    ("FROM $NOPE\n", r"\$NOPE has no value"),
    ("FROM a b c d\n", "FROM"),
    ("FROM a \\\n", "continuation"),
])
def test_dockerfile_errors(text, match) -> None:
    with pytest.raises(ImageError, match=match):
        dockerfile.prepare(text, {}, lambda ref: Path("/x"))


def test_inside_never_leaves_the_root(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("/usr/lib")  # absolute: means the image's /usr/lib
    (root / "opt").symlink_to("/etc")  # a hostile link: must stay under root
    (root / "up").symlink_to("../../../../..")
    assert inside(root, "/lib/modules") == root / "usr" / "lib" / "modules"
    assert inside(root, "/opt/sandlot/agent") == root / "etc" / "sandlot" / "agent"
    assert inside(root, "/up/etc/passwd") == root / "etc" / "passwd"
    assert inside(root, "../../x") == root / "x"


def test_resolve_user(tmp_path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n"
                                             "app:x:1000:1000::/home/app:/bin/sh\n")
    assert resolve_user(tmp_path, None) is None
    assert resolve_user(tmp_path, "root") is None
    assert resolve_user(tmp_path, "app") == "app"
    assert resolve_user(tmp_path, "1000:1000") == "app"
    with pytest.raises(ImageError, match="not in its /etc/passwd"):
        resolve_user(tmp_path, "nobody")


async def test_create_from_a_bad_reference_is_a_typed_400(afast) -> None:
    """Through the SDK, the app and core (fake machines): nothing is pulled or built, the
    request carries the image and the long read timeout a first build needs."""
    from sandlot import AsyncSandlot, ImageError, InvalidArgumentError

    async with AsyncSandlot("http://sandlot.test", afast.key,
                            transport=afast.transport) as client:
        with pytest.raises(ImageError, match="invalid image reference"):
            await client.sandboxes.create(image="Not A Reference!")
        request = afast.requests[-1]
        assert request.extensions["timeout"]["read"] == 1800
        assert json.loads(request.content)["image"] == "Not A Reference!"
        with pytest.raises(InvalidArgumentError, match="give one of"):
            await client.sandboxes.create(snapshot_id="snap-1", image="python:3")


async def test_a_known_tag_creates_while_its_registry_is_down(tmp_path, monkeypatch) -> None:
    """A reference the server resolved before creates from the template it named then when
    the registry does not answer; one it never resolved is the registry's error."""
    from sandlot.core import templates
    from sandlot.core.templates import TemplateStore
    from sandlot.runtime.fake import FakeRuntime
    from sandlot.testing import fake_settings, install_fake_template

    settings = fake_settings(tmp_path)
    runtime = FakeRuntime()
    store = TemplateStore(settings, runtime)
    name = "image-" + "ab" * 8
    install_fake_template(settings, runtime, name)
    up = True

    def resolve(ref, access):
        if not up:
            raise ImageError("cannot fetch image: connection refused")
        return ref.at(DIGEST)

    monkeypatch.setattr(oci, "resolve", resolve)
    monkeypatch.setattr(templates, "image_template_current", lambda info, digest, images: True)
    assert (await store.image_source("reg:5000/app:1")).template == name
    up = False
    assert (await store.image_source("reg:5000/app:1")).template == name
    with pytest.raises(ImageError, match="connection refused"):
        await store.image_source("reg:5000/other:1")


async def test_an_image_template_of_another_sandlot_is_rebuilt(tmp_path, monkeypatch) -> None:
    """A create's template whose build hash is not what this sandlot would build (its guest
    files changed since) is built again; a current one is used as it is."""
    from sandlot.core import templates
    from sandlot.core.templates import TemplateStore
    from sandlot.images import pipeline
    from sandlot.runtime.fake import FakeRuntime
    from sandlot.testing import fake_settings, install_fake_template

    settings = fake_settings(tmp_path)
    runtime = FakeRuntime()
    store = TemplateStore(settings, runtime)
    name = "image-" + "ab" * 8
    install_fake_template(settings, runtime, name)
    built: list[str] = []
    monkeypatch.setattr(oci, "resolve", lambda ref, access: ref.at(DIGEST))
    monkeypatch.setattr(templates, "pull_image_template",
                        lambda ref, name, **kw: built.append(ref))
    assert not pipeline.image_template_current(store.get(name), DIGEST, settings.images)
    assert (await store.image_source("reg:5000/app:1")).template == name
    assert built == [f"reg:5000/app@{DIGEST}"]
    monkeypatch.setattr(templates, "image_template_current", lambda info, digest, images: True)
    assert (await store.image_source("reg:5000/app:1")).template == name
    assert len(built) == 1


def test_a_login_file_holds_one_login_for_its_block() -> None:
    import base64
    import os
    import stat

    ref = oci.parse_reference("127.0.0.1:5000/team/app:1")
    with oci.login_file(ref, "builder", "pa:ss") as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        auths = json.loads(Path(path).read_text())["auths"]
        assert list(auths) == ["127.0.0.1:5000"]
        assert base64.b64decode(auths["127.0.0.1:5000"]["auth"]) == b"builder:pa:ss"
        flags = oci.Access.of(auth_file=path).flags(ref, "src")
        assert f"--src-authfile={path}" in flags and not any("pa:ss" in f for f in flags)
    assert not os.path.exists(path)
    with oci.login_file(oci.parse_reference("python"), "u", "p") as path:
        assert list(json.loads(Path(path).read_text())["auths"]) == ["docker.io"]


def test_a_pinned_reference_is_looked_up_when_verified(monkeypatch) -> None:
    import hashlib

    manifest = b'{"schemaVersion": 2}'
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    asked: list[list[str]] = []

    def skopeo(args, ref, access):
        asked.append(args)
        return manifest
    monkeypatch.setattr(oci, "_skopeo", skopeo)
    ref = oci.parse_reference(f"127.0.0.1:5000/app@{digest}")
    assert oci.resolve(ref, oci.Access()) is ref and asked == []
    assert oci.resolve(ref, oci.Access(), verify=True).digest == digest
    assert asked[-1][-1] == f"docker://127.0.0.1:5000/app@{digest}"
    with pytest.raises(ImageError, match="another digest"):
        oci.resolve(ref.at(DIGEST), oci.Access(), verify=True)
