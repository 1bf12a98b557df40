"""The OpenAI Agents SDK on sandlot (sandlot.integrations.openai_agents) against real VMs, the
way the SDK tests its providers' sessions (exec, files, PTY, exposed ports, persist and
resume, serialized state) plus what sandlot adds: a resumed session finds its processes
running, a session forks; and one agent run through `Runner` with the SDK's scripted model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import pytest
from agents import RunConfig, Runner  # noqa: E402
from agents.items import ToolCallOutputItem  # noqa: E402
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig  # noqa: E402
from agents.sandbox.entries import File  # noqa: E402
from agents.sandbox.errors import (  # noqa: E402
    ExecTimeoutError,
    ExposedPortUnavailableError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.snapshot import LocalSnapshotSpec  # noqa: E402
from agents.testing import ScriptedModel, assistant_message, function_call  # noqa: E402

from sandlot import Sandbox  # noqa: E402
from sandlot.integrations.openai_agents import (  # noqa: E402
    SandlotSandboxClient,
    SandlotSandboxClientOptions,
    SandlotSandboxSessionState,
    decode_snapshot_ref,
)

pytestmark = pytest.mark.vm
SLEEPER = "nohup sleep 100000 >/dev/null 2>&1 &"


@pytest.fixture
async def client(server):
    c = SandlotSandboxClient()
    yield c
    for info in await c.sandlot.sandboxes.list({"case": "openai-agents"}):
        await c.sandlot.sandboxes.kill(info.sandbox_id)
    await c.aclose()


def _options(**kw) -> SandlotSandboxClientOptions:
    return SandlotSandboxClientOptions(timeout=900, metadata={"case": "openai-agents"}, **kw)


def _manifest() -> Manifest:
    return Manifest(entries={"hello.txt": File(content=b"hello from the manifest\n")})


async def _sleeper_pid(session) -> str:
    result = await session.exec("pgrep -x sleep")
    return result.stdout.decode().strip()


async def test_exec_files_and_ports(client):
    session = await client.create(manifest=_manifest(), options=_options(exposed_ports=(8000,)))
    async with session:
        result = await session.exec("pwd; cat hello.txt; echo err >&2; exit 3")
        assert result.exit_code == 3
        assert result.stdout.decode() == "/workspace\nhello from the manifest\n"
        assert result.stderr.decode() == "err\n"
        assert (await session.exec("whoami", user="user")).stdout == b"user\n"

        await session.write(Path("data/blob.bin"), io.BytesIO(bytes(range(256))))
        assert (await session.read(Path("data/blob.bin"))).read() == bytes(range(256))
        assert (await session.exec("wc -c < /workspace/data/blob.bin")).stdout == b"256\n"
        with pytest.raises(WorkspaceReadNotFoundError):
            await session.read(Path("missing.txt"))
        names = {entry.path for entry in await session.ls(".")}
        assert any(n.endswith("hello.txt") for n in names)

        with pytest.raises(ExecTimeoutError):
            await session.exec("sleep 30", timeout=1)

        await session.exec("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        endpoint = await session.resolve_exposed_port(8000)
        url = endpoint.url_for("http") + "/hello.txt"
        for _ in range(100):
            try:
                answer = httpx.get(url, timeout=5)
                break
            except httpx.TransportError:
                await session.exec("sleep 0.2")
        assert answer.status_code == 200
        assert answer.text == "hello from the manifest\n"
        with pytest.raises(ExposedPortUnavailableError):
            await session.resolve_exposed_port(9000)  # not among the options' exposed_ports


async def test_pty(client):
    session = await client.create(options=_options())
    async with session:
        assert session.supports_pty()
        update = await session.pty_exec_start("echo done", yield_time_s=5)
        assert update.exit_code == 0
        assert update.process_id is None
        assert b"done" in update.output

        update = await session.pty_exec_start("cat", tty=True, yield_time_s=1)
        assert update.exit_code is None
        pid = update.process_id
        update = await session.pty_write_stdin(session_id=pid, chars="typed\r",
                                               yield_time_s=2)
        assert b"typed" in update.output
        update = await session.pty_write_stdin(session_id=pid, chars="\x04", yield_time_s=5)
        assert update.exit_code == 0
        assert update.process_id is None

        update = await session.pty_exec_start("sleep 1000", yield_time_s=0.3)
        assert update.process_id is not None
        await session.pty_terminate_all()
        assert await _sleeper_pid(session) == ""


async def test_persist_then_resume_finds_processes_alive(client, tmp_path):
    """stop() persists the workspace as a sandlot snapshot with memory; the sandbox is then
    killed; a resume from the serialized state restores that snapshot, and the background
    process started before the persist runs on, with the same pid."""
    session = await client.create(manifest=_manifest(),
                                  snapshot=LocalSnapshotSpec(base_path=tmp_path),
                                  options=_options())
    async with session:
        await session.exec(SLEEPER)
        pid = await _sleeper_pid(session)
        assert pid
        await session.write(Path("runtime.txt"), io.BytesIO(b"written at run time\n"))
        first_id = session.state.sandbox_id
        await session.stop()  # two persists now, a third at the exit:
        await session.stop()  # the session keeps its newest two snapshots
    # aclose ran stop (persist) and shutdown (kill)
    assert (await client.sandlot.sandboxes.get_info(first_id)).state == "stopped"
    stored = (tmp_path / f"{session.state.snapshot.id}.tar").read_bytes()
    assert decode_snapshot_ref(stored) == session.state.persisted_snapshots[-1]
    kept = {s.snapshot_id for s in await client.sandlot.snapshots.list(sandbox_id=first_id)}
    assert kept == set(session.state.persisted_snapshots)
    assert len(kept) == 2

    payload = json.loads(json.dumps(client.serialize_session_state(session.state)))
    state = client.deserialize_session_state(payload)
    assert isinstance(state, SandlotSandboxSessionState)
    resumed = await client.resume(state)
    async with resumed:
        assert resumed.state.sandbox_id != first_id
        assert await _sleeper_pid(resumed) == pid
        assert (await resumed.read(Path("runtime.txt"))).read() == b"written at run time\n"
        assert (await resumed.exec("cat hello.txt")).stdout == b"hello from the manifest\n"


async def test_pause_on_exit_then_resume_reattaches(client):
    session = await client.create(options=_options(pause_on_exit=True))
    async with session:
        await session.exec(SLEEPER)
        pid = await _sleeper_pid(session)
        sandbox_id = session.state.sandbox_id
    assert (await client.sandlot.sandboxes.get_info(sandbox_id)).state == "paused"
    resumed = await client.resume(client.deserialize_session_state(
        client.serialize_session_state(session.state)))
    async with resumed:
        assert resumed.state.sandbox_id == sandbox_id
        assert await _sleeper_pid(resumed) == pid
        resumed.state.pause_on_exit = False  # this time, kill it at the end


async def test_session_from_warmed_snapshot_and_fork(client):
    """Sessions restored from a sandlot snapshot find its files and process; a fork carries
    both and diverges from its parent."""
    with Sandbox.create(timeout=600) as setup:
        setup.files.write("/workspace/ready.txt", "set up\n")
        setup.commands.start("sleep 100000")
        snap = setup.create_snapshot().wait()
    session = await client.create(options=_options(snapshot=snap.snapshot_id))
    async with session:
        assert (await session.exec("cat ready.txt")).stdout == b"set up\n"
        pid = await _sleeper_pid(session)
        assert pid
        await session.exec("echo parent > mine.txt")
        children = await client.fork(session, 2)
        assert len(children) == 2
        async with children[0] as a, children[1] as b:
            assert a.state.sandbox_id != b.state.sandbox_id != session.state.sandbox_id
            assert a.state.session_id != session.state.session_id
            assert (await a.exec("cat ready.txt mine.txt")).stdout == b"set up\nparent\n"
            assert await _sleeper_pid(b) == pid
            await a.exec("echo child > mine.txt")
            assert (await b.exec("cat mine.txt")).stdout == b"parent\n"
        assert (await session.exec("cat mine.txt")).stdout == b"parent\n"
    await client.sandlot.snapshots.delete(snap.snapshot_id)


async def test_runner_end_to_end(client):
    """An agent run with the SDK's scripted model: its shell tool runs in a sandlot VM."""
    model = ScriptedModel([
        [function_call("exec_command", {"cmd": "cat hello.txt && uname -s"}, call_id="c1")],
        [assistant_message("done")],
    ])
    agent = SandboxAgent(name="sandlot", model=model, instructions="Use the shell.",
                         default_manifest=_manifest())
    result = await Runner.run(agent, "read the file", run_config=RunConfig(
        sandbox=SandboxRunConfig(client=client, options=_options())))
    assert result.final_output == "done"
    outputs = [str(item.output) for item in result.new_items
               if isinstance(item, ToolCallOutputItem)]
    assert len(outputs) == 1
    assert "hello from the manifest" in outputs[0]
    assert "Linux" in outputs[0]


def test_options_and_state_parse_by_type():
    """The SDK finds sandlot's options and state by their `type`, as it does its own
    providers' when it loads a saved run."""
    from agents.sandbox.session.sandbox_client import BaseSandboxClientOptions
    from agents.sandbox.snapshot import NoopSnapshot

    options = BaseSandboxClientOptions.parse(
        {"type": "sandlot", "snapshot": "warmed", "exposed_ports": [8000]})
    assert isinstance(options, SandlotSandboxClientOptions)
    assert options.snapshot == "warmed"
    assert options.exposed_ports == (8000,)
    state = SandlotSandboxSessionState(sandbox_id="sb-1", manifest=Manifest(),
                                       snapshot=NoopSnapshot(id="s"), pause_on_exit=True)
    again = SandlotSandboxSessionState.parse(json.loads(state.model_dump_json()))
    assert isinstance(again, SandlotSandboxSessionState)
    assert (again.sandbox_id, again.pause_on_exit) == ("sb-1", True)


async def test_hydrate_from_a_workspace_tar(client):
    """A workspace persisted as a tar (another provider's) is extracted into the root."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"from a tar\n"
        info = tarfile.TarInfo("sub/moved.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    session = await client.create(options=_options())
    async with session:
        await session.hydrate_workspace(io.BytesIO(buf.getvalue()))
        assert (await session.exec("cat sub/moved.txt")).stdout == b"from a tar\n"


async def test_resume_without_a_snapshot_starts_a_new_sandbox(client):
    """No snapshot stored and the sandbox gone: the resume starts a new one and the manifest
    is applied again."""
    session = await client.create(manifest=_manifest(), options=_options())
    async with session:
        first_id = session.state.sandbox_id
    resumed = await client.resume(session.state)
    async with resumed:
        assert resumed.state.sandbox_id != first_id
        assert (await resumed.exec("cat hello.txt")).stdout == b"hello from the manifest\n"


async def test_runner_interrupted_then_resumed_finds_its_process(client, tmp_path):
    """A run that stops for an approval persists its sandbox (a snapshot with memory) and
    kills it; the run resumed from its saved state runs in a sandbox restored from that
    snapshot, where the process the first run started is still running."""
    from agents import function_tool
    from agents.run_state import RunState

    @function_tool(name_override="approval_tool", needs_approval=True)
    def approval_tool() -> str:
        return "approved"

    def make_agent(model: ScriptedModel) -> SandboxAgent:
        return SandboxAgent(name="sandlot", model=model, instructions="Use the shell.",
                            default_manifest=_manifest(), tools=[approval_tool])

    config = RunConfig(sandbox=SandboxRunConfig(
        client=client, options=_options(), snapshot=LocalSnapshotSpec(base_path=tmp_path)))
    first = await Runner.run(make_agent(ScriptedModel([
        [function_call("exec_command", {"cmd": SLEEPER}, call_id="c1")],
        [function_call("approval_tool", {}, call_id="c2")],
    ])), "start a server", run_config=config)
    assert len(first.interruptions) == 1
    saved = first.to_state().to_json()
    first_id = saved["sandbox"]["session_state"]["sandbox_id"]
    assert (await client.sandlot.sandboxes.get_info(first_id)).state == "stopped"

    agent = make_agent(ScriptedModel([
        [function_call("exec_command", {"cmd": "pgrep -x sleep >/dev/null && echo alive"},
                       call_id="c3")],
        [assistant_message("done")],
    ]))
    state = await RunState.from_json(agent, saved)
    state.approve(state.get_interruptions()[0])
    second = await Runner.run(agent, state, run_config=config)
    assert second.final_output == "done"
    outputs = [str(item.output) for item in second.new_items
               if isinstance(item, ToolCallOutputItem)]
    assert any("alive" in out for out in outputs), outputs
