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

    # langchain-tests 1.1.9 (its latest release) was cut for deepagents 0.6, and 7 of its tests
    # assert 0.6's contract, which deepagents 0.7's protocol reverses: `glob` answers the
    # absolute paths of files only (the glob tool promises the model absolute paths, and
    # deepagents' permission rules match absolute paths only), and `write` replaces an existing
    # file (the write_file tool's "replaces it entirely"). With deepagents 0.6.12 the backend
    # passes all 86; 0.7 is what LangChain users run, so the backend keeps 0.7's behaviour,
    # tested by the two `test_deepagents_07_*` cases below. The suite's own
    # test_no_overrides_DO_NOT_OVERRIDE allows a standard test to be overridden only as an
    # xfail; strict, and only on an assertion, so a crash or a reconciling release shows up.
    _07 = "langchain-tests 1.1.9 asserts deepagents 0.6's contract; 0.7: "
    _GLOB = _07 + "glob answers absolute paths"

    @pytest.mark.xfail(reason=_GLOB, strict=True, raises=AssertionError)
    def test_glob(self, sandbox_backend, sandbox_test_root):
        super().test_glob(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_GLOB, strict=True, raises=AssertionError)
    def test_glob_basic_pattern(self, sandbox_backend, sandbox_test_root):
        super().test_glob_basic_pattern(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_07 + "glob matches files only", strict=True,
                       raises=AssertionError)
    def test_glob_with_directories(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_directories(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_GLOB, strict=True, raises=AssertionError)
    def test_glob_hidden_files_explicitly(self, sandbox_backend, sandbox_test_root):
        super().test_glob_hidden_files_explicitly(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_GLOB, strict=True, raises=AssertionError)
    def test_glob_with_character_class(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_character_class(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_GLOB, strict=True, raises=AssertionError)
    def test_glob_with_question_mark(self, sandbox_backend, sandbox_test_root):
        super().test_glob_with_question_mark(sandbox_backend, sandbox_test_root)

    @pytest.mark.xfail(reason=_07 + "write replaces an existing file", strict=True,
                       raises=AssertionError)
    def test_write_existing_file_fails(self, sandbox_backend, sandbox_test_root):
        super().test_write_existing_file_fails(sandbox_backend, sandbox_test_root)

    def test_deepagents_07_glob(self, sandbox_backend, sandbox_test_root):
        """The xfailed glob cases as deepagents 0.7 specifies them: absolute paths, regular
        files only (not directories), hidden names only for a pattern that starts with a dot,
        a bare pattern matching at any depth."""
        base = self.sandbox_path("g", root_dir=sandbox_test_root)
        sandbox_backend.execute(f"mkdir -p {base}/dir1 {base}/dir2/sub")
        for name in ("x.py", "file1.txt", "file2.txt", "file10.txt", "fileA.txt", ".hidden",
                     "dir2/sub/deep.txt"):
            assert sandbox_backend.write(f"{base}/{name}", "content").error is None

        def paths(pattern: str) -> list[str]:
            result = sandbox_backend.glob(pattern, path=base)
            assert result.error is None
            assert result.matches is not None
            return sorted(m["path"] for m in result.matches)

        assert paths("*.py") == [f"{base}/x.py"]
        assert paths("file?.txt") == [f"{base}/file1.txt", f"{base}/file2.txt",
                                      f"{base}/fileA.txt"]
        assert paths("file[1-2].txt") == [f"{base}/file1.txt", f"{base}/file2.txt"]
        assert paths(".*") == [f"{base}/.hidden"]
        assert paths("/*.txt") == [f"{base}/{n}" for n in (
            "file1.txt", "file10.txt", "file2.txt", "fileA.txt")]
        everything = paths("*")
        assert f"{base}/dir2/sub/deep.txt" in everything
        assert not any(p.endswith(("/dir1", "/dir2", "/sub", "/.hidden")) for p in everything)
        assert len(everything) == 6

    def test_deepagents_07_write_replaces(self, sandbox_backend, sandbox_test_root):
        """`write` of an existing file replaces its content (deepagents 0.7)."""
        path = self.sandbox_path("existing.txt", root_dir=sandbox_test_root)
        assert sandbox_backend.write(path, "First content").error is None
        result = sandbox_backend.write(path, "Second")
        assert result.error is None
        assert result.path == path
        assert sandbox_backend.execute(f"cat {path}").output == "Second"

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
        # stdout and stderr are two pipes: the output is in the order the agent read them,
        # which for two writes a moment apart may be either (CI, under load, got "err" first)
        result = await backend.aexecute("echo out; sleep 1; echo err >&2; exit 3")
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
    file tools run in a sandlot VM: write_file creates and then replaces a file, glob answers
    absolute paths, execute sees what they wrote."""
    from deepagents import create_deep_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, ToolMessage

    class ScriptedChat(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    def call(n: int, name: str, **args: str) -> AIMessage:
        return AIMessage(content="", tool_calls=[{"name": name, "id": f"c{n}", "args": args}])

    script = iter([
        call(1, "write_file", file_path="/srv/agent/note.txt", content="draft"),
        call(2, "write_file", file_path="/srv/agent/note.txt", content="from the agent"),
        call(3, "glob", pattern="*.txt", path="/srv/agent"),
        call(4, "execute", command="cat /srv/agent/note.txt; echo; uname -s"),
        AIMessage(content="done"),
    ])
    backend = provider.create()
    try:
        agent = create_deep_agent(model=ScriptedChat(messages=script), backend=backend)
        result = agent.invoke({"messages": [{"role": "user", "content": "go"}]})
        assert result["messages"][-1].content == "done"
        tools = [m for m in result["messages"] if isinstance(m, ToolMessage)]
        assert [m.status for m in tools] == ["success"] * 4
        assert tools[1].content == "Updated file /srv/agent/note.txt"
        assert tools[2].content == "['/srv/agent/note.txt']"
        assert "from the agent" in tools[3].content
        assert "Linux" in tools[3].content
        assert backend.sandbox.files.read("/srv/agent/note.txt") == "from the agent"
    finally:
        provider.delete(sandbox_id=backend.id)
