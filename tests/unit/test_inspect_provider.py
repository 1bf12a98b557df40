"""The Inspect AI provider's pure parts: config loading, the output tail, error mapping (its
VM tests are tests/integrations/test_inspect_ai.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("inspect_ai")

from sandlot.errors import InvalidArgumentError, NotFoundError  # noqa: E402
from sandlot.integrations.inspect_ai import (  # noqa: E402
    SandlotConfig,
    _os_error,
    _Tail,
    load_config,
)


def test_config_from_none_a_template_name_a_file_and_a_model(tmp_path):
    assert load_config(None) == SandlotConfig()
    assert load_config("python-dev").template == "python-dev"
    path = tmp_path / "sandlot.json"
    path.write_text(json.dumps({"template": "base", "setup": "apt-get install -y git"}))
    assert load_config(str(path)).setup == "apt-get install -y git"
    yml = tmp_path / "sandlot.yaml"
    yml.write_text("image: python:3.12-slim\nuser: agent\n")
    assert load_config(str(yml)) == SandlotConfig(image="python:3.12-slim", user="agent")
    cfg = SandlotConfig(setup="true")
    assert load_config(cfg) is cfg
    with pytest.raises(ValueError):
        SandlotConfig.model_validate({"api_key": "secret"})  # never in a config (Inspect logs it)


def test_provider_is_registered_as_sandlot():
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    from sandlot.integrations.inspect_ai import SandlotSandboxEnvironment

    assert registry_find_sandboxenv("sandlot") is SandlotSandboxEnvironment
    restored = SandlotSandboxEnvironment.config_deserialize({"template": "t", "timeout": 60})
    assert restored == SandlotConfig(template="t", timeout=60)


def test_tail_keeps_the_last_bytes_and_whole_characters():
    tail = _Tail(10)
    for chunk in ("0123456789", "abc", "é€"):
        tail.add(chunk)
    text = tail.text()
    assert len(text.encode()) <= 10 and text.endswith("abcé€")
    small = _Tail(100)
    small.add("hello")
    assert small.text() == "hello"


def test_errors_map_to_the_os_errors_inspect_expects():
    assert isinstance(_os_error(NotFoundError("/a/b: no such file or directory"), "b"),
                      FileNotFoundError)
    assert isinstance(_os_error(InvalidArgumentError("/etc: is a directory"), "/etc"),
                      IsADirectoryError)
    err = _os_error(InvalidArgumentError("open /x: permission denied"), "x")
    assert isinstance(err, PermissionError) and "x" in str(err)
    from inspect_ai.util import SandboxUnavailableError

    assert isinstance(_os_error(NotFoundError("sandbox sb-1 not found"), "f"),
                      SandboxUnavailableError)


def test_config_is_hashable_with_env():
    a, b = SandlotConfig(env={"A": "1"}), SandlotConfig(env={"A": "1"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_a_config_string_may_name_a_dockerfile(tmp_path) -> None:
    from sandlot.integrations.inspect_ai import _context_hash, load_config

    for name in ("Dockerfile", "env/Dockerfile", "task.Dockerfile", "Dockerfile.dev"):
        assert load_config(name).dockerfile == name and load_config(name).template == "base"
    assert load_config("python-env").dockerfile is None
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    (tmp_path / "a").write_text("1")
    first = _context_hash(tmp_path / "Dockerfile", tmp_path)
    assert _context_hash(tmp_path / "Dockerfile", tmp_path) == first
    (tmp_path / "a").write_text("2")
    assert _context_hash(tmp_path / "Dockerfile", tmp_path) != first
