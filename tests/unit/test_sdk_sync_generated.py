"""The sync SDK is generated from the async one; fail if someone forgot to regenerate it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "unasync.py"


def _unasync():
    spec = importlib.util.spec_from_file_location("sandlot_unasync", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_sdk_is_up_to_date() -> None:
    stale = _unasync().stale()
    assert not stale, f"run `python scripts/unasync.py`; out of date: {stale}"


def test_sync_sdk_has_no_async_left() -> None:
    unasync = _unasync()
    for path, text in unasync.generate().items():
        code = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
        for token in ("async ", "await ", "AsyncClient", "aiter_", "__aenter__", "asyncio"):
            assert token not in code, f"{token!r} left in {path.name}"


def test_unasync_keeps_continuation_alignment() -> None:
    src = ("class A:\n"
           "    async def f(self, a: int,\n"
           "                b: AsyncFoo) -> None:\n"
           "        x = await g(1,\n"
           "                    2)\n"
           "        y = await h(\n"
           "            3)\n")
    assert _unasync().unasync_text(src) == (
        "class A:\n"
        "    def f(self, a: int,\n"
        "          b: Foo) -> None:\n"
        "        x = g(1,\n"
        "              2)\n"
        "        y = h(\n"
        "            3)\n")
