"""The CLI against a real server: sandbox and snapshot commands, --json output, exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def cli(server, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "SANDLOT_URL": server.url, "SANDLOT_API_KEY": server.key}
    proc = subprocess.run([sys.executable, "-m", "sandlot.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"sandlot {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
    return proc


@pytest.fixture
def sandbox_id(server):
    info = json.loads(cli(server, "sandbox", "create", "--json", "--env", "GREETING=hi",
                          "--metadata", "by=cli").stdout)
    yield info["sandbox_id"]
    cli(server, "sandbox", "kill", info["sandbox_id"], check=False)


def test_sandbox_commands(server, sandbox_id):
    listed = json.loads(cli(server, "sandbox", "list", "--json").stdout)
    assert sandbox_id in [s["sandbox_id"] for s in listed]
    out = cli(server, "sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo $GREETING; exit 4",
              check=False)
    assert out.returncode == 4 and out.stdout == "hi\n"
    info = json.loads(cli(server, "sandbox", "get", sandbox_id, "--json").stdout)
    assert info["metadata"] == {"by": "cli"}
    cli(server, "sandbox", "kill", sandbox_id)
    gone = cli(server, "sandbox", "exec", sandbox_id, "--", "true", check=False)
    assert gone.returncode == 1 and "error:" in gone.stderr and "Traceback" not in gone.stderr


def test_snapshot_fork_rollback_commands(server, sandbox_id):
    cli(server, "sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo one > /root/state")
    snap = json.loads(cli(server, "snapshot", "create", sandbox_id, "--name",
                          f"cli-{sandbox_id}", "--wait", "--json").stdout)
    assert snap["state"] == "ready"
    got = json.loads(cli(server, "snapshot", "get", f"cli-{sandbox_id}", "--json").stdout)
    assert got["snapshot_id"] == snap["snapshot_id"]
    assert snap["snapshot_id"] in [s["snapshot_id"] for s in
                                   json.loads(cli(server, "snapshot", "list", "--json").stdout)]

    cli(server, "sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo two > /root/state")
    kids = json.loads(cli(server, "sandbox", "fork", sandbox_id, "--count", "2", "--json").stdout)
    kid_ids = [k["sandbox_id"] for k in (kids["sandboxes"] if isinstance(kids, dict) else kids)]
    assert len(kid_ids) == 2
    for kid in kid_ids:
        assert cli(server, "sandbox", "exec", kid, "--", "cat", "/root/state").stdout == "two\n"
        cli(server, "sandbox", "kill", kid)

    cli(server, "sandbox", "rollback", sandbox_id, f"cli-{sandbox_id}")
    assert cli(server, "sandbox", "exec", sandbox_id, "--", "cat",
               "/root/state").stdout == "one\n"

    restored = json.loads(cli(server, "snapshot", "restore", snap["snapshot_id"],
                              "--json").stdout)
    assert cli(server, "sandbox", "exec", restored["sandbox_id"], "--", "cat",
               "/root/state").stdout == "one\n"
    cli(server, "sandbox", "kill", restored["sandbox_id"])
    cli(server, "snapshot", "rm", f"cli-{sandbox_id}")
    missing = cli(server, "snapshot", "get", f"cli-{sandbox_id}", check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr.lower()


def test_keys_create_list_and_revoke(tmp_path):
    def keys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", *args,
                               "--data-dir", str(tmp_path)], capture_output=True, text=True,
                              check=True)

    out = keys("create")
    key = out.stdout.strip()
    assert key.startswith("sl_") and len(key) > 20
    tenant = out.stderr.split("tenant:")[1].split()[0]  # a new tenant of its own
    from sandlot.core.db import run_sync
    from sandlot.core.db.sqlite import SqliteStore

    def principal(k: str):
        return run_sync(SqliteStore(tmp_path / "sandlot.db").key_principal(k))

    assert principal(key) == (tenant, False)
    e2b_key = keys("create", "--e2b", "--tenant", tenant).stdout.strip()
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", e2b_key)
    assert principal(e2b_key) == (tenant, False)  # a second key of the same tenant
    admin = keys("create", "--admin", "--tenant", "ops").stdout.strip()
    assert principal(admin) == ("ops", True)
    assert keys("create").stderr.split("tenant:")[1].split()[0] != tenant
    rows = json.loads(keys("list", "--json").stdout)
    assert [r["tenant"] for r in rows].count(tenant) == 2 and len(rows) == 4
    assert key not in json.dumps(rows)
    keys("revoke", rows[0]["key_id"])
    assert principal(key) is None and principal(e2b_key) == (tenant, False)
