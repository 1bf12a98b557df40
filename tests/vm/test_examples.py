"""Every script in examples/ runs against a real server, exits 0, and cleans up after itself
(no sandbox or snapshot left behind)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandlot import Sandbox, Snapshot

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example(script: Path, server, oci_images) -> None:
    sandboxes = {s.sandbox_id for s in Sandbox.list()}
    snapshots = {s.snapshot_id for s in Snapshot.list()}
    env = {**os.environ, "SANDLOT_URL": server.url, "SANDLOT_API_KEY": server.key,
           "SANDLOT_EXAMPLE_IMAGE": oci_images["debian"]}  # the image examples' image
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{proc.stdout}\n" \
                                 f"{proc.stderr[-3000:]}"
    assert {s.sandbox_id for s in Sandbox.list()} == sandboxes, "the example left sandboxes"
    assert {s.snapshot_id for s in Snapshot.list()} == snapshots, "the example left snapshots"
