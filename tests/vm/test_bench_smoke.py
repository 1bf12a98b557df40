"""The benchmark runs end to end and its JSON is complete (no timing assertions: figures on a
shared CI machine mean little; `make bench` is where they are read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES_DIR = Path(os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))

pytestmark = pytest.mark.vm

REQUIRED = [
    "cold_boot_ms", "create_ms_p50", "exec_ms_p50", "file_mb_s", "snapshot_pause_ms_p50",
    "snapshot_ready_ms_p50", "restore_ms_p50", "fork1_ms_p50", "fork8_wall_ms",
    "fork32_wall_ms", "fork_private_mib", "fork_pss_mib", "idle20_pss_mib",
    "snapshot_stored_mib", "peer_restore_ms_p50", "peer_fork8_wall_ms", "accel", "host",
]
MAY_BE_NULL = {"peer_restore_ms_p50", "peer_fork8_wall_ms"}  # the smoke run skips the peer


def test_bench_smoke_writes_complete_json(tmp_path):
    if not (IMAGES_DIR / "templates" / "base.json").exists():
        pytest.fail("the base template is not built: run `make setup`")
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--json", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    missing = [k for k in REQUIRED if k not in report]
    assert not missing, missing
    null = [k for k in REQUIRED if report[k] is None and k not in MAY_BE_NULL]
    assert not null, (null, report.get("errors"))
    for key in REQUIRED:
        if key not in ("accel", "host") and report[key] is not None:
            assert isinstance(report[key], int | float) and report[key] >= 0, (key, report[key])
    assert report["accel"] in ("kvm", "tcg")
    assert {"cores", "ram_gib", "cpu_model"} <= set(report["host"])
    assert report["errors"] == {}
    assert "unavailable" in report["peer"]  # and it says why
    assert "sandlot bench" in proc.stdout  # the table was printed
