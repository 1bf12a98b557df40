"""The Inspect AI provider (sandlot.integrations.inspect_ai) against real VMs: Inspect's own
sandbox self-check suite, samples restored from the task's warmed snapshot, fork, cleanup and
an end-to-end `eval` with Inspect's mock model."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from inspect_ai.util._sandbox.self_check import *  # noqa: E402, F403 - Inspect's checks

from sandlot import AsyncSandlot  # noqa: E402
from sandlot.integrations.inspect_ai import (  # noqa: E402
    TAG,
    SandlotConfig,
    SandlotSandboxEnvironment,
)

# One event loop for the module: a sample is shared by the checks of its config. (Inspect's
# eval, sync: test_inspect_ai_eval.py.)
pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module")]

TASK = "sandlot-selfcheck"
# The task's setup: a file, and a process that must still run in every sample.
SETUP = ("mkdir -p /opt/warm && echo ready > /opt/warm/marker && "
         "(setsid sleep 100000 >/dev/null 2>&1 < /dev/null &)")
# As Inspect runs its checks for docker: as root, and as a user of the template's own.
CONFIGS = {"root": SandlotConfig(setup=SETUP, timeout=1800),
           "nonroot": SandlotConfig(setup=SETUP + " && useradd -m agent", user="agent",
                                    timeout=1800)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def inspect_task(request, server):
    cfg = CONFIGS[request.param]
    asyncio.run(SandlotSandboxEnvironment.task_init(TASK, cfg))
    yield TASK, cfg
    asyncio.run(SandlotSandboxEnvironment.task_cleanup(TASK, cfg, True))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sample(inspect_task):
    """One sample's environment, restored from the task's snapshot, for every check of its
    config (as Inspect's own runner shares one)."""
    name, cfg = inspect_task
    envs = await SandlotSandboxEnvironment.sample_init(name, cfg, {})
    yield envs["default"]
    await SandlotSandboxEnvironment.sample_cleanup(name, cfg, envs, False)


@pytest_asyncio.fixture(loop_scope="module")
async def sandbox_env(sample):
    """What Inspect's checks ask for (function-scoped, as its self_check wants)."""
    return sample


async def test_sample_starts_from_the_warm_snapshot(sandbox_env):
    assert await sandbox_env.read_file("/opt/warm/marker") == "ready\n"
    ps = await sandbox_env.exec(["sh", "-c", "ps -eo args | grep '^sleep 100000' | grep -v grep"])
    assert ps.success and "sleep 100000" in ps.stdout
    info = await sandbox_env.sandlot.get_info()
    assert info.snapshot_id is not None and info.metadata.get(TAG) == "sample"


async def test_fork_copies_the_sample_as_it_is(sandbox_env):
    await sandbox_env.write_file("state.txt", "reached")
    copies = await sandbox_env.fork(2)
    assert len(copies) == 2
    for i, copy in enumerate(copies):
        assert await copy.read_file("state.txt") == "reached"
        await copy.write_file("state.txt", f"copy {i}")
    assert await sandbox_env.read_file("state.txt") == "reached"
    assert [await c.read_file("state.txt") for c in copies] == ["copy 0", "copy 1"]
    await copies[0].close()
    assert not await copies[0].sandlot.is_running()
    assert await copies[1].sandlot.is_running()


async def test_exec_output_keeps_the_tail_past_the_limit(sandbox_env):
    from inspect_ai.util._sandbox.limits import override_max_exec_output_size

    with override_max_exec_output_size(1000):
        result = await sandbox_env.exec(["sh", "-c", "seq 1 2000; echo end"])
    assert result.success and len(result.stdout.encode()) <= 1000
    assert result.stdout.endswith("1999\n2000\nend\n")


async def test_exec_unknown_cwd_and_binary_output(sandbox_env):
    bad = await sandbox_env.exec(["ls"], cwd="/no/such/dir")
    assert not bad.success and "/no/such/dir" in bad.stderr
    out = await sandbox_env.exec(["printf", "a\\377b"])
    assert out.stdout == "a\ufffdb"


async def test_write_keeps_an_existing_files_mode_and_owner(sandbox_env):
    await sandbox_env.write_file("/tmp/run.sh", "#!/bin/sh\necho one\n")
    await sandbox_env.exec(["chmod", "750", "/tmp/run.sh"], user="root")
    await sandbox_env.exec(["chown", "nobody", "/tmp/run.sh"], user="root")
    await sandbox_env.write_file("/tmp/run.sh", "#!/bin/sh\necho two\n")
    stat = await sandbox_env.exec(["stat", "-c", "%a %U", "/tmp/run.sh"])
    assert stat.stdout == "750 nobody\n"
    assert (await sandbox_env.exec(["/tmp/run.sh"], user="root")).stdout == "two\n"


async def test_connection_names_the_sandbox(sandbox_env):
    conn = await sandbox_env.connection()
    assert conn.type == "sandlot" and sandbox_env.sandlot.sandbox_id in conn.command


async def test_cli_cleanup_kills_what_is_left(inspect_task):
    """Last in this file: it also deletes the task snapshots of this provider."""
    name, cfg = inspect_task
    envs = await SandlotSandboxEnvironment.sample_init(name, cfg, {})
    left = envs["default"].sandlot
    await SandlotSandboxEnvironment.cli_cleanup(None)
    assert not await left.is_running()
    async with AsyncSandlot() as client:
        assert not await client.sandboxes.list({TAG: "sample"})
        assert not [s for s in await client.snapshots.list()
                    if (s.name or "").startswith("inspect-")]
    await envs["default"].close()
