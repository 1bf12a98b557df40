"""Configuration is read in one place (config.py: `Settings.from_env`) and handed down; the
server's modules read no environment of their own but for the justified exceptions below. And
making Settings probes nothing on the host."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sandlot import config
from sandlot.config import Settings
from sandlot.vmm import write_tracking

SRC = Path(config.__file__).parent
# Not the server: programs of their own (the SDK, its integrations and the CLI, which read
# their users' SANDLOT_URL/SANDLOT_API_KEY, TERM and SANDLOT_DEBUG) and the test harness.
CLIENTS = ("sdk/", "integrations/", "cli.py", "shell.py", "testing.py", "config.py")
# Reads of the environment that are no sandlot configuration: file -> why.
ALLOWED = {
    "vmm/machine.py": "QEMU's environment: the server's, plus the write-tracking preload",
    "runtime/lazy.py": "the lazy-restore mount process's environment: the server's",
    "images/egress.py": "skopeo's environment: the server's, its proxy variables replaced",
    "images/guest.py": "PATH for the Go toolchain that builds the guest programs",
    "storage/objects.py": "the S3 client's standard AWS_* variables (obstore reads them too; "
                          "sandlot only picks the defaults that depend on them)",
}


def environment_reads(path: Path) -> list[int]:
    """The lines of `path` that touch os.environ or os.getenv (or import them from os)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "environb", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_config_reads_the_environment() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(CLIENTS):
            found[rel] = environment_reads(path)
    assert "core/service.py" in found and "server/app.py" in found  # the scan sees them
    unexpected = {f: lines for f, lines in found.items() if lines and f not in ALLOWED}
    assert not unexpected, (
        "read the environment in config.py (a Settings field) and pass the value down; or, "
        f"if it is no sandlot configuration, name the file in ALLOWED: {unexpected}")
    stale = sorted(f for f in ALLOWED if not found.get(f))
    assert not stale, f"these files read no environment any more; drop them: {stale}"


def test_making_settings_probes_no_accelerator(monkeypatch) -> None:
    def probe() -> str:
        raise AssertionError("/dev/kvm probed")

    monkeypatch.setattr(config, "detect_accel", probe)
    monkeypatch.delenv("SANDLOT_ACCEL", raising=False)
    settings = Settings.from_env("/tmp/sandlot-config-test")
    Settings()
    with pytest.raises(AssertionError, match="probed"):
        _ = settings.accelerator  # probed when asked
    monkeypatch.setenv("SANDLOT_ACCEL", "tcg")
    assert Settings.from_env("/tmp/sandlot-config-test").accelerator == "tcg"


def test_image_and_capture_settings_from_the_environment(monkeypatch) -> None:
    for name in ("SANDLOT_REGISTRIES", "SANDLOT_INSECURE_REGISTRIES",
                 "SANDLOT_REGISTRY_AUTH_FILE", "SANDLOT_BUILDAH_DRIVER",
                 "SANDLOT_WRITE_TRACKING"):
        monkeypatch.delenv(name, raising=False)
    default = Settings.from_env("/tmp/sandlot-config-test")
    assert (default.registries, default.insecure_registries, default.registry_auth_file,
            default.buildah_driver, default.write_tracking) == (None, (), None, "overlay", True)
    monkeypatch.setenv("SANDLOT_REGISTRIES", "mirror.internal")
    monkeypatch.setenv("SANDLOT_INSECURE_REGISTRIES", " reg:5000, ,other:1")
    monkeypatch.setenv("SANDLOT_REGISTRY_AUTH_FILE", "/etc/auth.json")
    monkeypatch.setenv("SANDLOT_BUILDAH_DRIVER", "vfs")
    monkeypatch.setenv("SANDLOT_WRITE_TRACKING", "off")
    s = Settings.from_env("/tmp/sandlot-config-test")
    assert (s.registries, s.insecure_registries, s.registry_auth_file, s.buildah_driver,
            s.write_tracking) == ("mirror.internal", ("reg:5000", "other:1"), "/etc/auth.json",
                                  "vfs", False)


def test_the_net_table_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SANDLOT_NET_TABLE", raising=False)
    assert Settings.from_env("/tmp/sandlot-config-test").net_table == "sandlot"
    monkeypatch.setenv("SANDLOT_NET_TABLE", "sandlot_ab12")
    assert Settings.from_env("/tmp/sandlot-config-test").net_table == "sandlot_ab12"


def test_write_tracking_off_preloads_nothing() -> None:
    assert write_tracking.qemu_env(False) == {}
