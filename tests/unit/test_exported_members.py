"""Keep `sandlot.__all__` honest: everything public is listed, everything listed exists and is
documented, and the SDK's modules stay private."""

from __future__ import annotations

import inspect
import pkgutil
import types

import sandlot
import sandlot.errors
import sandlot.sdk

REQUIRED = {
    "Sandbox", "AsyncSandbox", "Snapshot", "AsyncSnapshot", "Sandlot", "AsyncSandlot",
    "SandboxInfo", "SnapshotInfo", "TemplateInfo", "ProcessInfo", "EntryInfo", "CommandResult",
    "CommandExitError", "SnapshotFailedError", "WaitTimeoutError",
}


def test_all_is_complete_and_exists() -> None:
    exported = set(sandlot.__all__)
    assert len(exported) == len(sandlot.__all__), "duplicates in __all__"
    assert REQUIRED <= exported
    assert set(sandlot.errors.ERRORS) <= exported
    for name in exported:
        assert hasattr(sandlot, name), name
    public = {name for name, value in vars(sandlot).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public == exported, f"public but not in __all__: {public - exported}"


def test_exports_are_documented_and_from_sandlot() -> None:
    for name in sandlot.__all__:
        obj = getattr(sandlot, name)
        assert obj.__module__.startswith("sandlot."), name
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_public_methods_are_documented() -> None:
    for name in ("Sandbox", "AsyncSandbox", "Snapshot", "AsyncSnapshot", "Sandlot",
                 "AsyncSandlot", "Commands", "AsyncCommands", "CommandHandle",
                 "AsyncCommandHandle", "Files", "AsyncFiles"):
        cls = getattr(sandlot, name)
        for attr, member in vars(cls).items():
            if attr.startswith("_") or not callable(getattr(member, "__func__", member)):
                continue
            assert inspect.getdoc(getattr(cls, attr)), f"{name}.{attr} has no docstring"


def test_sdk_errors_join_the_tree() -> None:
    for name in ("CommandExitError", "SnapshotFailedError", "WaitTimeoutError"):
        assert issubclass(getattr(sandlot, name), sandlot.SandlotError)
    assert issubclass(sandlot.SnapshotFailedError, sandlot.SandboxError)


def test_sdk_modules_are_private() -> None:
    for info in pkgutil.walk_packages(sandlot.sdk.__path__, "sandlot.sdk."):
        leaf = info.name.rsplit(".", 1)[-1]
        assert leaf.startswith("_"), f"{info.name} should be private"
    assert set(sandlot.sdk.__all__) <= set(sandlot.__all__)
