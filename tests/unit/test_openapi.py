"""The checked-in openapi.yaml is the app's own schema (regenerate: python scripts/openapi.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_openapi_yaml_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "openapi.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
