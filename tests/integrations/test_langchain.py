"""LangChain Deep Agents on sandlot (sandlot.integrations.langchain) against real VMs:
langchain-tests' sandbox standard suite, the provider's get/create/list/delete/reconnect,
a sandbox started from a warmed snapshot, and a fork."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_tests.integration_tests import SandboxIntegrationTests  # noqa: E402

from sandlot import NotFoundError  # noqa: E402
from sandlot.integrations.langchain import SandlotBackend, SandlotProvider  # noqa: E402

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def provider(server) -> Iterator[SandlotProvider]:
    prov = SandlotProvider(timeout=1200)
    yield prov
    for item in prov.list()["items"]:
        prov.delete(sandbox_id=item["sandbox_id"])
    prov.close()


class TestSandlotSandboxStandard(SandboxIntegrationTests):
    """The standard suite, as the base template's unprivileged ``user`` (as root a chmod 000
    file is readable, which the suite's permission test does not expect)."""

    # langchain-tests 1.1.9 (its latest release) predates two changes of deepagents 0.7's own
    # `BaseSandbox`, which the backend inherits: `glob` answers absolute paths of files
    # (deepagents' permission rules match absolute paths only), and `write` overwrites an
    # existing file. These tests assert the older behaviour; strict, so a release that
    # reconciles them shows up here.
    _SKEW = "langchain-tests 1.1.9 predates deepagents 0.7 BaseSandbox's "

    @pytest.mark.xfail(reason=_SKEW + "absolute glob paths", strict=True)
    def test_glob(self, sandbox_backend, sandbox_test_root):
        super().test_glob(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "absolute glob paths", strict=True)
    def test_glob_basic_pattern(self, sandbox_backend, sandbox_test_root):
        super().test_glob_basic_pattern(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "glob of files only, absolute", strict=True)
    def test_glob_with_directories(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_directories(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "absolute glob paths", strict=True)
    def test_glob_hidden_files_explicitly(self, sandbox_backend, sandbox_test_root):
        super().test_glob_hidden_files_explicitly(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "absolute glob paths", strict=True)
    def test_glob_with_character_class(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_character_class(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "absolute glob paths", strict=True)
    def test_glob_with_question_mark(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_question_mark(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_SKEW + "write that overwrites", strict=True)
    def test_write_existing_file_fails(self, sandbox_backend, sandbox_test_root):
        super().test_write_existing_file_fails(sandbox_backend, sandbox_test_root)

    @pytest.fixture(scope="class")
    def sandbox(self, server) -> Iterator[SandlotBackend]:
        prov = SandlotProvider(user="user", timeout=1800)
        backend = prov.create()
        # The suite runs `python -c`; Debian's base template has python3 only.
        backend.sandbox.commands.run("ln -sf /usr/bin/python3 /usr/local/bin/python",
                                     user="root", check=True)
        try:
            yield backend
        finally:
            prov.delete(sandbox_id=backend.id)
            prov.close()


def test_provider_create_get_list_delete(provider):
    backend = provider.create(metadata={"case": "lifecycle"})
    assert backend.id.startswith("sb-")
    assert backend.execute("echo hello").output.strip() == "hello"

    again = provider.get(sandbox_id=backend.id)
    assert again.id == backend.id
    assert provider.get_or_create(sandbox_id=backend.id).id == backend.id
    ids = [i["sandbox_id"] for i in provider.list(metadata={"case": "lifecycle"})["items"]]
    assert ids == [backend.id]

    provider.delete(sandbox_id=backend.id)
    provider.delete(sandbox_id=backend.id)  # idempotent
    provider.delete(sandbox_id="definitely-not-a-real-sandbox-id")
    with pytest.raises(NotFoundError):
        provider.get(sandbox_id=backend.id)
    with pytest.raises(NotFoundError):
        provider.get(sandbox_id="definitely-not-a-real-sandbox-id")
    assert backend.id not in [i["sandbox_id"] for i in provider.list()["items"]]


async def test_provider_async(provider):
    backend = await provider.aget_or_create()
    try:
        assert (await provider.aget(sandbox_id=backend.id)).id == backend.id
        result = await backend.aexecute("echo out; echo err >&2; exit 3")
        assert result.exit_code == 3
        assert result.output == "out\nerr\n"
        assert backend.id in [i["sandbox_id"] for i in (await provider.alist())["items"]]
    finally:
        await provider.adelete(sandbox_id=backend.id)


def test_execute_timeout_kills_the_command(provider):
    backend = provider.create()
    try:
        result = backend.execute("echo started; sleep 60", timeout=2)
        assert result.exit_code == 124
        assert result.output.startswith("started\n")
        assert "timed out after 2 seconds" in result.output
        assert backend.execute("pgrep -x sleep || echo none").output.strip() == "none"
    finally:
        provider.delete(sandbox_id=backend.id)


def test_warmed_snapshot_and_fork(provider):
    """A provider whose sandboxes start from a snapshot finds the setup's files and the
    process the setup started; a fork carries both, and diverges from its parent."""
    setup = provider.create()
    try:
        setup.write("/srv/app/ready.txt", "set up\n")
        setup.sandbox.commands.start("sleep 100000")
        snap = setup.sandbox.create_snapshot("deepagents-warm").wait()
    finally:
        provider.delete(sandbox_id=setup.id)

    warm = SandlotProvider(snapshot=snap.snapshot_id, timeout=600)
    backend = warm.create()
    children: list[SandlotBackend] = []
    try:
        assert backend.read("/srv/app/ready.txt").file_data["content"].rstrip() == "set up"
        assert backend.execute("pgrep -x sleep >/dev/null && echo alive").output == "alive\n"
        children = backend.fork(2)
        assert len(children) == 2
        children[0].write("/srv/app/child.txt", "mine")
        assert children[0].execute("cat /srv/app/ready.txt /srv/app/child.txt").output == (
            "set up\nmine")
        assert children[1].execute("test -e /srv/app/child.txt; echo $?").output == "1\n"
        assert children[1].execute("pgrep -x sleep >/dev/null && echo alive").output == (
            "alive\n")
    finally:
        for b in (backend, *children):
            warm.delete(sandbox_id=b.id)
        warm.client.snapshots.delete(snap.snapshot_id)
        warm.close()


def test_deep_agent_end_to_end(provider):
    """A Deep Agent (deepagents' create_deep_agent, a scripted chat model) whose shell and
    file tools run in a sandlot VM."""
    from deepagents import create_deep_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, ToolMessage

    class ScriptedChat(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    script = iter([
        AIMessage(content="", tool_calls=[{
            "name": "write_file", "id": "c1",
            "args": {"file_path": "/srv/agent/note.txt", "content": "from the agent"}}]),
        AIMessage(content="", tool_calls=[{
            "name": "execute", "id": "c2",
            "args": {"command": "cat /srv/agent/note.txt; echo; uname -s"}}]),
        AIMessage(content="done"),
    ])
    backend = provider.create()
    try:
        agent = create_deep_agent(model=ScriptedChat(messages=script), backend=backend)
        result = agent.invoke({"messages": [{"role": "user", "content": "go"}]})
        assert result["messages"][-1].content == "done"
        tool_output = [m.content for m in result["messages"] if isinstance(m, ToolMessage)]
        assert len(tool_output) == 2
        assert "from the agent" in tool_output[1]
        assert "Linux" in tool_output[1]
        assert backend.sandbox.files.read("/srv/agent/note.txt") == "from the agent"
    finally:
        provider.delete(sandbox_id=backend.id)
