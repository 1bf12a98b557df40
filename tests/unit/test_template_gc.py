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
