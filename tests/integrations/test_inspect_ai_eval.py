"""Inspect AI runs evals on the sandlot provider itself: in process with `eval()`, and from
the command line (`inspect eval --sandbox sandlot`, found by its entry point), with Inspect's
mock model."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sandlot import Sandlot
from sandlot.integrations.inspect_ai import TAG, SandlotConfig

pytestmark = pytest.mark.vm
# The task's setup: a file every sample must see.
SETUP = "mkdir -p /opt/warm && echo ready > /opt/warm/marker"


def test_eval_with_the_mock_model(server, tmp_path):
    """A two-sample task run by Inspect itself (task_init, samples, scorer, cleanup). No
    `generate()`: the mock model's token count would fetch a tokenizer from the network."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    @solver
    def read_marker():
        async def solve(state, generate_):
            echo = f"echo {state.input}-$(cat /opt/warm/marker)"
            state.output.completion = (await sandbox().exec(["sh", "-c", echo])).stdout
            return state
        return solve

    with Sandlot(**server.client_kwargs()) as client:
        seen_setups = {s.sandbox_id for s in client.sandboxes.list({TAG: "setup"},
                                                                   include_stopped=True)}
    task = Task(dataset=[Sample(input="one", target="one-ready"),
                         Sample(input="two", target="two-ready")],
                solver=read_marker(), scorer=includes(),
                sandbox=("sandlot", SandlotConfig(setup=SETUP, timeout=600)))
    with Sandlot(**server.client_kwargs()) as client:
        before = {s.snapshot_id for s in client.snapshots.list()}
        [log] = eval(task, model="mockllm/model", log_dir=str(tmp_path), display="none")
        assert log.status == "success", log.error
        assert [s.scores["includes"].value for s in log.samples] == ["C", "C"]
        # Inspect's task_init ("startup") made the one task snapshot both samples restored, and
        # its task_cleanup ("shutdown") deleted it
        setups = client.sandboxes.list({TAG: "setup"}, include_stopped=True)
        assert len([s for s in setups if s.sandbox_id not in seen_setups]) == 1
        left = [s for s in client.snapshots.list() if s.snapshot_id not in before]
        assert left == [], left


CLI_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import solver
from inspect_ai.util import sandbox


@solver
def shell():
    async def solve(state, generate):
        result = await sandbox().exec(["sh", "-c", f"echo {state.input} from $(hostname)"])
        state.output.completion = result.stdout
        return state
    return solve


@task
def two_samples():
    return Task(dataset=[Sample(input="one", target="one from"),
                         Sample(input="two", target="two from")],
                solver=shell(), scorer=includes())
"""


def test_inspect_eval_cli_finds_the_provider(server, tmp_path):
    """`inspect eval --sandbox sandlot` with the mock model: Inspect finds the provider by its
    entry point (installed by `pip install -e .`)."""
    eps = importlib.metadata.entry_points(group="inspect_ai")
    # `make setup` installs sandlot with its entry points (pip install -e '.[test]')
    assert any(ep.name == "sandlot" for ep in eps), "run `make setup`"
    (tmp_path / "two.py").write_text(CLI_TASK)
    run = subprocess.run(
        [str(Path(sys.executable).parent / "inspect"), "eval", "two.py", "--sandbox", "sandlot",
         "--model", "mockllm/model", "--log-dir", "logs", "--log-format", "json",
         "--display", "plain"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [log_file] = (tmp_path / "logs").glob("*.json")
    log = json.loads(log_file.read_text())
    assert log["status"] == "success"
    assert [s["scores"]["includes"]["value"] for s in log["samples"]] == ["C", "C"]
    cleanup = subprocess.run(
        [str(Path(sys.executable).parent / "inspect"), "sandbox", "cleanup", "sandlot"],
        capture_output=True, text=True, timeout=300)
    assert cleanup.returncode == 0 and "sandlot: killed" in cleanup.stdout, cleanup.stderr


def test_without_a_snapshot_every_sample_runs_the_setup(server, tmp_path):
    """`snapshot=False`: no task snapshot; each sample's sandbox is created and set up on its
    own (two samples see two different setups' results)."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    @solver
    def read_setup():
        async def solve(state, generate_):
            state.output.completion = (await sandbox().read_file("/opt/warm/id")).strip()
            return state
        return solve

    setup = "mkdir -p /opt/warm && cat /proc/sys/kernel/random/uuid > /opt/warm/id"
    task = Task(dataset=[Sample(input="one"), Sample(input="two")], solver=read_setup(),
                sandbox=("sandlot", SandlotConfig(setup=setup, snapshot=False, timeout=600)))
    [log] = eval(task, model="mockllm/model", log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    ids = {s.output.completion for s in log.samples}
    assert len(ids) == 2 and all(len(i) == 36 for i in ids), ids


DOCKERFILE = """FROM base
ARG GREETING=hello
COPY data/hello.txt /opt/task/
RUN echo "$GREETING built $(cat /opt/task/hello.txt)" > /opt/task/run.txt
COPY data/tool.sh /usr/local/bin/
RUN tool.sh >> /opt/task/run.txt
ENV TASK_MODE=dockerfile
WORKDIR /opt/task
CMD ["sleep", "infinity"]
"""


def test_a_task_whose_sandbox_is_a_dockerfile(server, tmp_path, monkeypatch):
    """``sandbox=("sandlot", "env/Dockerfile")``, relative to the task's folder: task_init has
    the server build it (FROM a template, a COPY from its folder, a RUN) into an
    `inspect-<hash>` template once; the samples see the COPY'd file, the RUN's effect, the ENV
    and the WORKDIR. Building it again through the SDK is served from the cache."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    (tmp_path / "env" / "data").mkdir(parents=True)
    (tmp_path / "env" / "Dockerfile").write_text(DOCKERFILE)
    (tmp_path / "env" / "data" / "hello.txt").write_text("from-context\n")
    (tmp_path / "env" / "data" / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    (tmp_path / "env" / "data" / "tool.sh").chmod(0o755)  # COPY keeps it executable
    monkeypatch.chdir(tmp_path)

    @solver
    def look():
        async def solve(state, generate_):
            result = await sandbox().exec(
                ["sh", "-c", f"echo {state.input}; pwd; cat hello.txt run.txt; "
                 "echo mode=$TASK_MODE"])
            state.output.completion = result.stdout + result.stderr
            return state
        return solve

    target = "/opt/task\nfrom-context\nhello built from-context\ntool ran\nmode=dockerfile"
    task = Task(dataset=[Sample(input="one", target=target),
                         Sample(input="two", target=target)],
                solver=look(), scorer=includes(), sandbox=("sandlot", "env/Dockerfile"))
    with Sandlot(**server.client_kwargs()) as client:
        before = {t.name for t in client.templates.list()}
    try:
        [log] = eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"),
                     display="none")
        assert log.status == "success", log.error
        outputs = [s.output.completion for s in log.samples]
        assert [s.scores["includes"].value for s in log.samples] == ["C", "C"], outputs
        with Sandlot(**server.client_kwargs()) as client:
            built = [t for t in client.templates.list() if t.name not in before]
            assert len(built) == 1 and built[0].name.startswith("inspect-"), built
            again = client.templates.build(
                built[0].name, dockerfile=str(tmp_path / "env" / "Dockerfile"), timeout=600)
            assert again.built_at == built[0].built_at  # served from the cache
    finally:  # templates live in the images folder the test servers share
        with Sandlot(**server.client_kwargs()) as client:
            for t in client.templates.list():
                if t.name not in before:
                    httpx.delete(f"{server.url}/e2b/templates/{t.name}",
                                 headers={"x-api-key": server.key}, timeout=60)
