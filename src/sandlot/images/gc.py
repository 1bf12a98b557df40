"""Template build GC (`sandlot template gc`): the builds under the images dir nothing needs
any more, and the OCI layouts no kept build was made from. What is in use (the template
index, the records of snapshots and sandboxes) is the caller's to say: core knows it
(`core.templates.builds_in_use`)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from sandlot import filelock
from sandlot.config import Settings
from sandlot.images.pipeline import BUILD_LOCK

LAYOUT_GRACE = 3600  # s: a layout this new may be about to be built (a Dockerfile's push)


def collect_garbage(settings: Settings, in_use: Callable[[], set[str]],
                    dry_run: bool = False) -> list[str]:
    """Remove the template builds nothing needs any more; returns their names.

    A build is kept while `in_use()` names it (asked under the build lock, so never while a
    build is in progress): a template points at it, or a snapshot or running sandbox was made
    from it (their restores map its kernel, initramfs and root filesystem).
    """
    root = settings.images
    builds = root / "builds"
    if not builds.exists():
        return []
    with filelock.exclusive(root / BUILD_LOCK):  # never a build in progress
        keep = in_use()
        unused = sorted(b.name for b in builds.iterdir()
                        if b.is_dir() and b.name not in keep)
        if not dry_run:
            for name in unused:
                shutil.rmtree(builds / name, ignore_errors=True)
        layouts = _unused_layouts(root, keep)
        if not dry_run:
            for layout in layouts:
                shutil.rmtree(layout, ignore_errors=True)
    return unused + [f"oci/{p.name}" for p in layouts]


def _unused_layouts(root: Path, keep: set[str]) -> list[Path]:
    """The pulled or built OCI layouts (images/oci/) no kept build was made from."""
    layouts = root / "oci"
    if not layouts.is_dir():
        return []
    wanted = set()
    for build in keep:
        try:
            record = json.loads((root / "builds" / build / "spec.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("image"), str):
            wanted.add(record["image"].removeprefix("sha256:"))
    old = time.time() - LAYOUT_GRACE
    return sorted(p for p in layouts.iterdir()
                  if p.is_dir() and p.name.removeprefix("built-") not in wanted
                  and p.stat().st_mtime < old)
