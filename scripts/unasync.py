"""Generate the sync SDK (src/sandlot/sdk/_sync/) from the async one (src/sandlot/sdk/_async/).

Plain token replacement, as in httpcore's scripts/unasync.py: ``async def`` -> ``def``,
``await x`` -> ``x``, ``AsyncFoo`` -> ``Foo``, ``aclose`` -> ``close`` and so on. The async code
is written so that this yields correct sync code; shared logic lives in ``sdk/_base.py``.

    python scripts/unasync.py          # regenerate
    python scripts/unasync.py --check  # exit 1 if _sync/ is out of date
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASYNC_DIR = ROOT / "src" / "sandlot" / "sdk" / "_async"
SYNC_DIR = ROOT / "src" / "sandlot" / "sdk" / "_sync"

SUBS: list[tuple[str, str]] = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    (r"\bAsync([A-Z]\w*)", r"\1"),
    (r"\baclose\b", "close"),
    (r"\baread\b", "read"),
    (r"\baiter_bytes\b", "iter_bytes"),
    (r"\baiter_lines\b", "iter_lines"),
    (r"\baupload_content\b", "upload_content"),
    (r"\bimport asyncio\b", "import time"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    # docstrings
    (r"\ban async iterator\b", "an iterator"),
    (r"\basync iterator\b", "iterator"),
    (r"``async with``", "``with``"),
    (r"\(async\) ", ""),
    (r"\(async\)", "(sync)"),
]
_COMPILED = [(re.compile(pattern), repl) for pattern, repl in SUBS]

HEADER = ("# Generated from src/sandlot/sdk/_async/{name} by scripts/unasync.py; do not edit.\n"
          "# ruff: noqa: I001\n")

INIT = ('"""The sync SDK, generated from `sandlot.sdk._async` by scripts/unasync.py. '
        'Do not edit."""\n')


def _brackets(text: str) -> list[tuple[int, int, str]]:
    """(row, col, char) of every bracket outside strings and comments."""
    return [
        (tok.start[0], tok.start[1], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.OP and tok.string in "()[]{}"
    ]


def _realign(orig: str, new: str) -> str:
    """Keep continuation lines aligned with their opening bracket after a line got shorter
    (``async def f(a,`` -> ``def f(a,``). Hanging indents are left alone."""
    events: dict[int, list[tuple[int, int, str]]] = {}
    for (row, ocol, char), (_, ncol, _) in zip(_brackets(orig), _brackets(new), strict=True):
        events.setdefault(row, []).append((ocol, ncol, char))
    out: list[str] = []
    stack: list[tuple[int, int]] = []  # (column in orig, column in output) of open brackets
    for row, (oline, nline) in enumerate(
            zip(orig.splitlines(True), new.splitlines(True), strict=True), start=1):
        shift = 0
        if stack and oline.strip():
            oindent = len(oline) - len(oline.lstrip(" "))
            if oindent == stack[-1][0] + 1:
                nindent = len(nline) - len(nline.lstrip(" "))
                shift = stack[-1][1] + 1 - nindent
                nline = " " * (nindent + shift) + nline.lstrip(" ")
        for ocol, ncol, char in events.get(row, []):
            if char in "([{":
                stack.append((ocol, ncol + shift))
            else:
                stack.pop()
        out.append(nline)
    return "".join(out)


def unasync_text(text: str) -> str:
    """Apply every substitution to `text`, then fix the alignment of continuation lines."""
    new = text
    for pattern, repl in _COMPILED:
        new = pattern.sub(repl, new)
    return _realign(text, new)


def generate() -> dict[Path, str]:
    """Map each file of the sync tree to the text it should have."""
    out: dict[Path, str] = {SYNC_DIR / "__init__.py": INIT}
    for src in sorted(ASYNC_DIR.glob("*.py")):
        if src.name == "__init__.py":
            continue
        out[SYNC_DIR / src.name] = HEADER.format(name=src.name) + unasync_text(src.read_text())
    return out


def stale() -> list[Path]:
    """Sync files that are missing, different, or no longer generated."""
    wanted = generate()
    bad = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    bad += [p for p in SYNC_DIR.glob("*.py") if p not in wanted]
    return bad


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        for path in bad:
            print(f"out of date: {path.relative_to(ROOT)}", file=sys.stderr)
        if bad:
            print("run: python scripts/unasync.py", file=sys.stderr)
        return 1 if bad else 0
    SYNC_DIR.mkdir(parents=True, exist_ok=True)
    wanted = generate()
    for path in SYNC_DIR.glob("*.py"):
        if path not in wanted:
            path.unlink()
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
