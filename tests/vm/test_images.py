"""Sandboxes from OCI images and Dockerfiles, against a real registry on loopback filled with
images the tests build locally (tests/imagekit.py): no test reaches the internet.

The busybox-only and musl images have no python3 or bash: sandlot's guest agent and init are
static binaries that need nothing from the image.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from sandlot import (
    BuildStepError,
    ImageError,
    ImageNotFoundError,
    InvalidArgumentError,
    Sandbox,
    Sandlot,
    Snapshot,
)
from sandlot.config import Settings
from sandlot.images import dockerfile, egress, oci, pipeline
from sandlot.images.imagefs import build_image_rootfs
from sandlot.images.kernel import ensure_kernel
from sandlot.testing import IMAGES_DIR


@pytest.fixture
def server_settings(server, monkeypatch) -> Settings:
    """The session server's settings (its images dir and store), for builds in the test's
    process that the server then creates from."""
    for key in ("SANDLOT_IMAGES_DIR", "SANDLOT_STORE", "SANDLOT_INSTANCE", "SANDLOT_DATA_DIR"):
        if key in server.env:
            monkeypatch.setenv(key, server.env[key])
    return Settings.from_env(server.data_dir)


def test_debian_image_sandbox(server, oci_images) -> None:
    """Create from an image (built on first use), the image's USER, WORKDIR and ENV honoured;
    files, a snapshot and its restore, a fork; the next create is a restore of the same
    template."""
    ref = oci_images["debian"]
    with Sandbox.create(image=ref, timeout=600) as sbx:
        assert sbx.info.template.startswith("image-")
        r = sbx.commands.run("id -un; pwd; echo $GREETING; cat /etc/image-name")
        assert r.stdout.split() == ["app", "/srv/app", "hello", "debian-image"], r
        assert sbx.commands.run("id -un", user="root").stdout.strip() == "root"
        sbx.files.write("/srv/app/in.txt", b"from the host\n")
        assert sbx.files.read("/srv/app/in.txt") == "from the host\n"
        sbx.commands.run("echo made-before > /srv/app/state.txt", check=True)
        snap = sbx.create_snapshot()
        children = sbx.fork(count=1)
        child = children[0]
        try:
            child.commands.run("echo child > /srv/app/state.txt", check=True)
            assert sbx.commands.run("cat /srv/app/state.txt").stdout == "made-before\n"
            assert child.commands.run("id -un").stdout.strip() == "app"
        finally:
            child.kill()
        snap.wait(timeout=300)
        restored = snap.restore()
        try:
            r = restored.commands.run("cat /srv/app/state.txt; id -un; pwd")
            assert r.stdout.split() == ["made-before", "app", "/srv/app"]
        finally:
            restored.kill()
            Snapshot.delete(snap.snapshot_id)
    with Sandlot() as client:
        info = client.templates.get(sbx.info.template)
        assert info.image and "@sha256:" in info.image and info.user == "app"
        assert info.workdir == "/srv/app" and info.cmd == ["/bin/bash"]
    with Sandbox.create(image=ref, timeout=60) as again:  # the same template: a restore
        assert again.info.template == sbx.info.template
        assert again.commands.run("true").exit_code == 0


def test_first_create_builds_once_without_blocking(server, registry, tmp_path) -> None:
    """Two creates from an image never built: one build, shared; meanwhile the API answers
    other requests at once. The template and its build are removed after."""
    import imagekit

    layout = imagekit.variant(imagekit.debian_layout(), tmp_path, f"RUN_ID={uuid.uuid4()}")
    ref = imagekit.push(layout, registry, "sandlot-test/fresh", uuid.uuid4().hex[:8])
    made: list[Sandbox] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            made.append(Sandbox.create(image=ref, timeout=300))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(2)]
    for t in threads:
        t.start()
    listed = answered_during_build = 0
    try:
        while any(t.is_alive() for t in threads):
            Sandbox.list()
            listed += 1
            answered_during_build += any(t.is_alive() for t in threads)
            time.sleep(0.5)
        for t in threads:
            t.join()
        assert not errors, errors
        assert len({s.info.template for s in made}) == 1
        # answered while the image was built, not held behind the build
        assert answered_during_build or not listed, (listed, answered_during_build)
        assert made[0].commands.run("echo $RUN_ID").stdout.strip()
    finally:
        for sbx in made:
            sbx.kill()
        if made:
            name = made[0].info.template
            info = json.loads((IMAGES_DIR / "templates" / f"{name}.json").read_text())
            (IMAGES_DIR / "templates" / f"{name}.json").unlink()
            shutil.rmtree(IMAGES_DIR / "builds" / info["hash"], ignore_errors=True)
            digest = info["image"].rsplit("@sha256:", 1)[1]
            shutil.rmtree(IMAGES_DIR / "oci" / digest, ignore_errors=True)


def test_image_errors(server, registry) -> None:
    """A bad reference is a 400, a missing image a 404, both typed; nothing is built."""
    with pytest.raises(ImageError, match="invalid image reference"):
        Sandbox.create(image="Not A Reference!")
    with pytest.raises(ImageNotFoundError, match="not found"):
        Sandbox.create(image=f"{registry.host}/sandlot-test/missing:latest")
    with pytest.raises(ImageNotFoundError):
        Sandbox.create(image=f"{registry.host}/sandlot-test/debian:no-such-tag")
    with pytest.raises(InvalidArgumentError, match="give one of"):
        Sandbox.create("base", image=f"{registry.host}/sandlot-test/debian:latest",
                       snapshot_id="snap-x")


def test_plain_http_registry_needs_naming(registry, oci_images) -> None:
    ref = oci.parse_reference(oci_images["busybox"])
    with pytest.raises(ImageError, match="SANDLOT_REGISTRIES"):  # loopback: not named
        oci.resolve(ref, oci.Access())
    named = egress.Policy(frozenset({registry.host}))
    with pytest.raises(ImageError, match="SANDLOT_INSECURE_REGISTRIES"):
        oci.resolve(ref, oci.Access(policy=named))
    pinned = oci.resolve(ref, oci.Access(frozenset({registry.host})))
    assert pinned.digest and pinned.digest.startswith("sha256:")


def test_dockerfile_template(server_settings, registry, oci_images, tmp_path) -> None:
    """A Dockerfile with several steps: the template runs with its ENV, WORKDIR, USER and
    copied files; a rebuild after a change runs from the first changed step only."""
    settings = server_settings
    access = oci.Access(frozenset({registry.host}))
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "data.txt").write_text("v1\n")
    (ctx / "Dockerfile").write_text(
        "ARG BASE\n"
        "FROM ${BASE}\n"
        "ARG WHO=world\n"
        "ENV TOOL_HOME=/opt/tool MODE=test\n"
        "USER root\n"
        "RUN mkdir -p /opt/tool && echo \"hello $WHO\" > /opt/tool/greeting\n"
        "COPY data.txt /opt/tool/data.txt\n"
        "RUN cat /opt/tool/data.txt > /opt/tool/copied && chown -R app /opt/tool\n"
        "EXPOSE 8080\n"
        "WORKDIR /opt/tool\n"
        "USER app\n"
        "CMD [\"python3\"]\n")
    args = {"BASE": oci_images["debian"]}
    warnings: list[str] = []
    info = pipeline.dockerfile_template(ctx / "Dockerfile", None, "test-dockerfile",
                                         settings=settings, access=access, build_args=args,
                                         quiet=True, warn=warnings.append)
    assert any("EXPOSE" in w for w in warnings)
    assert info.user == "app" and info.workdir == "/opt/tool"
    with Sandbox.create("test-dockerfile", timeout=120) as sbx:
        r = sbx.commands.run("id -un; pwd; echo $MODE; cat greeting copied")
        assert r.stdout.split() == ["app", "/opt/tool", "test", "hello", "world", "v1"], r

    # The step cache: change the COPY'd file (to what no earlier run built); the steps
    # before it come from the cache, the ones from it on run again.
    (ctx / "data.txt").write_text(f"v2 {uuid.uuid4()}\n")
    buildah = dockerfile.Buildah(settings.images / "buildah", settings.buildah_driver)
    prepared = dockerfile.prepare((ctx / "Dockerfile").read_text(), args,
                                  lambda r: pipeline._pull(oci.parse_reference(r), settings,
                                                            access, lambda _: None)[0])
    steps: list[str] = []
    buildah.build(prepared.text, ctx, args, steps.append)
    cached = [s for s in steps if s.endswith("(cached)")]
    assert any("RUN mkdir" in s for s in cached), steps
    assert not any("COPY" in s or "RUN cat" in s for s in cached), steps


def test_dockerfile_failing_run(server_settings, registry, oci_images, tmp_path) -> None:
    settings = server_settings
    (tmp_path / "Dockerfile").write_text(
        f"FROM {oci_images['debian']}\nRUN echo first-step\n"
        "RUN echo about to fail >&2 && ls /no/such/dir\n")
    with pytest.raises(BuildStepError) as err:
        pipeline.dockerfile_template(tmp_path / "Dockerfile", None, "test-bad",
                                      settings=settings,
                                      access=oci.Access(frozenset({registry.host})),
                                      quiet=True)
    assert "RUN echo about to fail" in err.value.message
    assert "about to fail" in err.value.message.splitlines()[1:][0]
    assert "/no/such/dir" in err.value.message


def test_cli_template_build_from_image(server, registry, oci_images) -> None:
    """`sandlot template build --image REF NAME` (cached by digest: the session's first
    create from this image built it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "template", "build", "--image",
         oci_images["debian"], "--insecure-registry", registry.host, "test-cli-image",
         "--data-dir", str(server.data_dir), "--json"],
        capture_output=True, text=True, timeout=600,
        env={**server.env, "SANDLOT_IMAGES_DIR": str(IMAGES_DIR)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Sandbox.create("test-cli-image", timeout=60) as sbx:
        assert sbx.commands.run("id -un").stdout.strip() == "app"


@pytest.mark.parametrize("name", ["busybox", "musl"])
def test_image_without_python_rootfs(name, oci_images, registry, tmp_path) -> None:
    """Images without python3 or bash become a guest tree: guest files, modules and their
    index (the host's depmod)."""
    if oci_images[name] is None:
        pytest.skip(f"this host cannot build the {name} image (musl-gcc missing)")
    settings = SimpleNamespace(images=tmp_path / "images")
    access = oci.Access(frozenset({registry.host}))
    layout, _ = pipeline._pull(oci.parse_reference(oci_images[name]), settings, access,
                                lambda _: None)
    kernel = ensure_kernel(IMAGES_DIR / "kernel")
    out = tmp_path / "rootfs.ext4"
    config = build_image_rootfs(layout, out, kernel, pipeline._guest_files(IMAGES_DIR))
    assert out.stat().st_size > 0 and config.user is None
    listing = subprocess.run(["debugfs", "-R", "ls -p /sbin", str(out)], capture_output=True,
                             text=True).stdout
    assert "sandlot-init" in listing
    agent = subprocess.run(["debugfs", "-R", "ls -p /opt/sandlot", str(out)],
                           capture_output=True, text=True).stdout
    assert "sandlot-agent" in agent  # static: nothing of the image's is needed


@pytest.mark.parametrize("name", ["busybox", "musl"])
def test_image_without_python_sandbox(name, server, oci_images) -> None:
    if oci_images[name] is None:
        pytest.skip(f"this host cannot build the {name} image (musl-gcc missing)")
    with Sandbox.create(image=oci_images[name], timeout=300) as sbx:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        if name == "musl":
            assert sbx.commands.run("hello").stdout == "hello from musl\n"
        sbx.files.write("/tmp/x", b"data")
        assert sbx.files.read("/tmp/x") == "data"
        snap = sbx.create_snapshot()
        child = sbx.fork(count=1)[0]
        try:
            assert child.commands.run("cat /tmp/x").stdout == "data"
        finally:
            child.kill()
        snap.wait(timeout=300)
        restored = snap.restore()
        try:
            assert restored.commands.run("cat /tmp/x").stdout == "data"
        finally:
            restored.kill()
            Snapshot.delete(snap.snapshot_id)

