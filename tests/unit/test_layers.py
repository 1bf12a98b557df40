"""The layers' rules (docs/design.md): the server reaches the machine layer only where the app
is set up, and core only through the runtime interface; the server does not reach round core
(its store, its runtime, its live VMs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sandlot"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_server_reaches_the_machine_layer_only_to_set_the_app_up() -> None:
    for path in sorted((SRC / "server").rglob("*.py")):
        low = {m for m in imports(path) if m.startswith(("sandlot.runtime", "sandlot.vmm"))}
        if path.name == "app.py":
            assert low <= {"sandlot.runtime.base", "sandlot.runtime.network",
                           "sandlot.runtime.qemu"}, low
        else:
            assert not low, f"{path.relative_to(SRC)} imports {low}"


def test_the_server_uses_cores_public_calls() -> None:
    reach = re.compile(r"\.(db|runtime)\.|\bsandboxes\.live\b|\bget_live\(|\._[a-z]\w*\(")
    for path in sorted((SRC / "server").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if (re.search(r"\b(core|c|ctx\.core|self\.core)\b", code) and reach.search(code)
                    or re.search(r"\bsandboxes\.live\b|\bget_live\(", code)):  # however reached
                raise AssertionError(f"{path.relative_to(SRC)}:{n}: {line.strip()}")


def test_core_reaches_the_machine_layer_through_the_runtime_interface() -> None:
    """Core's managers use `runtime.base` only (the template build pipeline, which boots on
    a runtime it is given, is images/pipeline.py's)."""
    for path in sorted((SRC / "core").rglob("*.py")):
        low = {m for m in imports(path) if m.startswith(("sandlot.runtime", "sandlot.vmm"))}
        assert low <= {"sandlot.runtime.base"}, f"{path.relative_to(SRC)} imports {low}"


def test_images_uses_no_layer_above_it_but_the_template_record() -> None:
    """images/ is below core (core imports it): of core it uses only the record a build
    writes (`core.models.TemplateInfo`), and nothing of the server."""
    for path in sorted((SRC / "images").rglob("*.py")):
        up = {m for m in imports(path) if m.startswith(("sandlot.core", "sandlot.server"))}
        assert up <= {"sandlot.core.models"}, f"{path.relative_to(SRC)} imports {up}"


def test_test_modules_have_names_of_their_own() -> None:
    """pytest imports test modules by their file name (no packages under tests/): two files of
    one name in two folders stop the whole suite at collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        if "node_modules" in path.parts:
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]}: one name"
        seen[path.name] = path
