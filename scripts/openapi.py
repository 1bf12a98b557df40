"""Write openapi.yaml from the app (`python scripts/openapi.py`), or check it (`--check`)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from sandlot.server.app import create_app

TARGET = Path(__file__).resolve().parent.parent / "openapi.yaml"


def render() -> str:
    schema = create_app().openapi()
    return yaml.safe_dump(schema, sort_keys=False, allow_unicode=True, width=100)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print("openapi.yaml is stale: run `python scripts/openapi.py`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
