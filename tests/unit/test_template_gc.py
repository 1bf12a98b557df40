"""`sandlot template gc`: unused template builds go; builds a template, a snapshot or a running
sandbox needs stay."""

from __future__ import annotations

import json

from click.testing import CliRunner

from sandlot.cli import cli
from sandlot.core.db import run_sync
from sandlot.core.db.sqlite import SqliteStore


def test_gc_removes_only_unused_builds(tmp_path, monkeypatch):
    images, data = tmp_path / "images", tmp_path / "data"
    for name in ("current", "of-a-snapshot", "of-a-sandbox", "of-a-deleted-snapshot", "old"):
        (images / "builds" / name).mkdir(parents=True)
        (images / "builds" / name / "rootfs.ext4").write_bytes(b"x")
    (images / "templates").mkdir()
    (images / "templates" / "base.json").write_text(json.dumps({
        "name": "base", "hash": "current", "memory_mb": 512, "cpus": 1}))
    data.mkdir()
    db = SqliteStore(data / "sandlot.db")
    run_sync(db.put_snapshot("snap-1", None, "ready", "", {"base": "of-a-snapshot"}, 1.0))
    run_sync(db.put_snapshot("snap-2", None, "deleted", "", {"base": "of-a-deleted-snapshot"},
                             2.0))
    run_sync(db.put_sandbox("sb-1", "running", "", {"base": "of-a-sandbox"}))
    run_sync(db.close())
    monkeypatch.setenv("SANDLOT_IMAGES_DIR", str(images))
    runner = CliRunner()

    dry = runner.invoke(cli, ["template", "gc", "--data-dir", str(data), "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["removed"] == ["of-a-deleted-snapshot", "old"]
    assert (images / "builds" / "old").exists()

    done = runner.invoke(cli, ["template", "gc", "--data-dir", str(data)])
    assert done.exit_code == 0, done.output
    assert "removed 2 unused template builds" in done.output
    assert sorted(p.name for p in (images / "builds").iterdir()) == [
        "current", "of-a-sandbox", "of-a-snapshot"]


def test_gc_removes_layouts_no_kept_build_came_from(tmp_path, monkeypatch):
    """Pulled and built OCI layouts go with the last build made from them; a recent one
    stays (a Dockerfile's result waits for its build outside the build lock)."""
    import os

    images, data = tmp_path / "images", tmp_path / "data"
    pulled, built, orphan, recent = "a" * 64, "b" * 64, "c" * 64, "d" * 64
    for name, image in (("from-pull", pulled), ("from-dockerfile", built)):
        (images / "builds" / name).mkdir(parents=True)
        (images / "builds" / name / "spec.json").write_text(
            json.dumps({"image": f"sha256:{image}", "memory_mb": 512}))
    (images / "templates").mkdir()
    for name in ("from-pull", "from-dockerfile"):
        (images / "templates" / f"{name}.json").write_text(json.dumps({
            "name": name, "hash": name, "memory_mb": 512, "cpus": 1}))
    for layout in (pulled, f"built-{built}", orphan, recent):
        (images / "oci" / layout).mkdir(parents=True)
        if layout != recent:
            os.utime(images / "oci" / layout, (1, 1))
    data.mkdir()
    monkeypatch.setenv("SANDLOT_IMAGES_DIR", str(images))
    done = CliRunner().invoke(cli, ["template", "gc", "--data-dir", str(data), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["removed"] == [f"oci/{orphan}"]
    assert sorted(p.name for p in (images / "oci").iterdir()) == sorted(
        [pulled, f"built-{built}", recent])
