"""The guest agent's and init's Go sources (src/sandlot/guest/go): `go vet` is clean, gofmt has
nothing to change, and the Go tests (the framing) pass. The protocol itself is checked against
the built agent in test_guest_protocol.py and test_guest_flow.py."""

from __future__ import annotations

import subprocess

from guestkit import CACHE

from sandlot.images.guest import GO_DIR, go_env


def go(*args: str) -> subprocess.CompletedProcess:
    CACHE.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["go", *args], cwd=GO_DIR, env=go_env(CACHE), capture_output=True,
                          text=True, timeout=300)


def test_go_vet_and_tests_pass() -> None:
    for args in (("vet", "./..."), ("test", "./...")):
        out = go(*args)
        assert out.returncode == 0, out.stdout + out.stderr


def test_gofmt_has_nothing_to_change() -> None:
    out = subprocess.run(["gofmt", "-l", "."], cwd=GO_DIR, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
