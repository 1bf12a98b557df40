"""bench/break.py's crash loop, at its smallest (two SIGKILLs of a server of its own, one
mid-snapshot and one mid-upload): it runs, its JSON is complete, and it saw nothing it must
not. The full loops and their figures: docs/security.md, "Tests that try to break it"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import IMAGES_DIR, ROOT

pytestmark = pytest.mark.vm


def test_crash_loop_smoke(tmp_path):
    if not (IMAGES_DIR / "templates" / "base.json").exists():
        pytest.fail("the base template is not built: run `make setup`")
    out = tmp_path / "crash.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "break.py"), "crash",
                           "--iterations", "2", "--fork", "1", "--calibrate", "1",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kills"] == {"snapshot": 1, "upload": 1, "fork": 0, "restore": 0}
    assert len(result["iterations"]) == 2 and "summary" in result
    assert result["failures"] == [], result["failures"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
