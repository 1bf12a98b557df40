"""Template builds from a spec: packages, pip, files, env, workdir, build commands; cached by
content hash; and a sandbox created from the template is a restore of its boot snapshot."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sandlot import Sandbox

SPEC = """
name = "test-custom"
packages = ["jq"]
pip = ["six==1.16.0"]
env = {{ GREETING = "hello from the template" }}
workdir = "/srv/app"
run = ["echo built-at-build-time > /srv/app/built.txt", "chown -R user:user /srv/app"]

[files]
"/srv/app/config.json" = "{config}"
"""


def build(spec_path, images_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "SANDLOT_IMAGES_DIR": str(images_dir)}
    return subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "template", "build", str(spec_path)],
        capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.timeout(1200)
def test_custom_template(server, tmp_path):
    from harness import IMAGES_DIR

    config = tmp_path / "config.json"
    config.write_text('{"answer": 42}')
    spec = tmp_path / "custom.toml"
    spec.write_text(SPEC.format(config=config))

    first = build(spec, IMAGES_DIR)
    assert first.returncode == 0, first.stderr + first.stdout
    second = build(spec, IMAGES_DIR)
    assert second.returncode == 0
    assert "up to date" in second.stdout + second.stderr  # an unchanged spec is not rebuilt

    box = Sandbox.create(template="test-custom")
    try:
        r = box.commands.run("pwd; echo $GREETING; jq .answer config.json; cat built.txt; "
                             "python3 -c 'import six; print(six.__version__)'")
        assert r.stdout.splitlines() == ["/srv/app", "hello from the template", "42",
                                         "built-at-build-time", "1.16.0"], r.stderr
        assert box.get_info().template == "test-custom"
    finally:
        box.kill()

    listed = subprocess.run([sys.executable, "-m", "sandlot.cli", "template", "list"],
                            capture_output=True, text=True,
                            env={**os.environ, "SANDLOT_IMAGES_DIR": str(IMAGES_DIR)})
    assert "test-custom" in listed.stdout


def test_bad_spec_is_a_clear_error(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text('name = "Bad Name!"\n')
    out = build(spec, tmp_path / "images")
    assert out.returncode == 1
    assert "error:" in out.stderr and "Traceback" not in out.stderr
