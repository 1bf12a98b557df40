"""E2B template builds with the unmodified `e2b` SDK's Template builder against a real server
(the steps run in a sandbox of the base image, then one snapshot) and real VMs: a Dockerfile
with a COPY and a RUN, the step builder, a failing step, a cached rebuild, `exists`, tenancy,
start commands, and a Terminal-Bench-style task. The templates build on the Debian test image
in the session's loopback registry."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException
from e2b.sandbox.filesystem.filesystem import WriteEntry

from harness import tenant_key

TIMEOUT = 900



BUILT = ("e2b-layered", "e2b-on-base", "e2b-dockerfile", "e2b-steps", "e2b-started",
         "task-csv-sum")


@pytest.fixture(scope="module")
def e2b(server, oci_images):
    """What a harness sets: the API and sandbox URLs and a (tenant's) key. The templates the
    tests built are deleted after them (the images dir is shared)."""
    opts = {"api_url": f"{server.url}/e2b", "sandbox_url": f"{server.url}/e2b/envd",
            "api_key": tenant_key(server, "builders")}
    yield {"opts": opts, "image": oci_images["debian"], "server": server}
    for name in BUILT:
        httpx.delete(f"{opts['api_url']}/templates/{name}",
                     headers={"X-API-KEY": opts["api_key"]})


def test_delete(e2b, dockerfile_template):
    """A tenant deletes its template (and the snapshot its sandboxes restore)."""
    Template.build(Template().from_image(e2b["image"]).run_cmd("true"), "e2b-deleted",
                   cpu_count=1, memory_mb=512, **e2b["opts"])
    headers = {"X-API-KEY": e2b["opts"]["api_key"]}
    r = httpx.delete(f"{e2b['opts']['api_url']}/templates/e2b-deleted", headers=headers)
    assert r.status_code == 204, r.text
    assert Template.exists("e2b-deleted", **e2b["opts"]) is False
    r = httpx.delete(f"{e2b['opts']['api_url']}/templates/e2b-deleted", headers=headers)
    assert r.status_code == 404 and set(r.json()) == {"code", "message"}


@pytest.fixture(scope="module")
def dockerfile_template(e2b, tmp_path_factory):
    """One template from a Dockerfile with a COPY of a local file and a RUN, shared."""
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "hello.txt").write_text("hello from the context\n")
    logs: list[str] = []
    template = Template(file_context_path=str(ctx)).from_dockerfile(
        f"FROM {e2b['image']}\n"
        "COPY hello.txt /opt/app/hello.txt\n"
        "RUN echo built-by-run > /opt/app/ran.txt && chmod 644 /opt/app/ran.txt\n"
        "ENV APP_MODE=test\n")
    info = Template.build(template, "e2b-dockerfile", cpu_count=1, memory_mb=512,
                          on_build_logs=lambda e: logs.append(str(e.message)), **e2b["opts"])
    return {"template": template, "info": info, "logs": logs}


def test_dockerfile_copy_and_run(e2b, dockerfile_template):
    assert dockerfile_template["info"].template_id == "e2b-dockerfile"
    with Sandbox.create("e2b-dockerfile", timeout=300, **e2b["opts"]) as sbx:
        assert sbx.files.read("/opt/app/hello.txt") == "hello from the context\n"
        assert sbx.files.read("/opt/app/ran.txt") == "built-by-run\n"
        out = sbx.commands.run("whoami; pwd; echo $APP_MODE")
        assert out.stdout.split() == ["user", "/home/user", "test"]
        # a harness uploads its files as `user`
        sbx.files.write("/home/user/task.txt", "x")
        assert sbx.commands.run("id -un && ls -l /home/user/task.txt").exit_code == 0


def test_a_rebuild_is_served_from_the_cache(e2b, dockerfile_template):
    logs: list[str] = []
    Template.build(dockerfile_template["template"], "e2b-dockerfile", cpu_count=1,
                   memory_mb=512, on_build_logs=lambda e: logs.append(str(e.message)),
                   **e2b["opts"])
    text = "\n".join(logs)
    assert "served from the cache" in text and "[1/" not in text  # no step ran again

    # in the background, polled as a harness polls it
    info = Template.build_in_background(dockerfile_template["template"], "e2b-dockerfile",
                                        cpu_count=1, memory_mb=512, **e2b["opts"])
    seen, offset = [], 0
    for _ in range(600):
        status = Template.get_build_status(info, logs_offset=offset, **e2b["opts"])
        offset += len(status.log_entries)
        seen += [e.message for e in status.log_entries]
        if status.status.value in ("ready", "error"):
            break
        time.sleep(0.5)
    assert status.status.value == "ready", seen
    assert any("served from the cache" in m for m in seen)


def test_exists_and_another_tenant(e2b, dockerfile_template):
    assert Template.exists("e2b-dockerfile", **e2b["opts"]) is True
    assert Template.exists("no-such-template", **e2b["opts"]) is False
    other = {**e2b["opts"], "api_key": tenant_key(e2b["server"], "others")}
    assert Template.exists("e2b-dockerfile", **other) is True  # E2B: exists, not yours
    with pytest.raises(Exception) as ei:
        Sandbox.create("e2b-dockerfile", **other)
    assert "not found" in str(ei.value)
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_image(e2b["image"]), "e2b-dockerfile", **other)
    assert "not yours" in str(ei.value)

    # made public by its owner: the other tenant's sandboxes restore it; it builds it still not
    url = f"{e2b['opts']['api_url']}/v2/templates/e2b-dockerfile"
    owner = {"X-API-KEY": e2b["opts"]["api_key"]}
    assert httpx.patch(url, json={"public": True}, headers=owner).status_code == 200
    try:
        sbx = Sandbox.create("e2b-dockerfile", **other)
        try:
            assert sbx.files.read("/opt/app/hello.txt") == "hello from the context\n"
        finally:
            sbx.kill()
        with pytest.raises(BuildException) as ei:
            Template.build(Template().from_image(e2b["image"]), "e2b-dockerfile", **other)
        assert "not yours" in str(ei.value)
    finally:
        assert httpx.patch(url, json={"public": False}, headers=owner).status_code == 200


def test_step_builder(e2b, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("A")
    template = (Template(file_context_path=str(tmp_path))
                .from_image(e2b["image"])
                .set_envs({"STAGE": "steps"})
                .copy("data", "/home/user/data/")
                .set_workdir("/home/user/work")
                .run_cmd("echo $STAGE > made.txt && cat /home/user/data/a.txt >> made.txt")
                .run_cmd("touch /etc/made-by-root", user="root"))
    Template.build(template, "e2b-steps", cpu_count=1, memory_mb=512, **e2b["opts"])
    with Sandbox.create("e2b-steps", timeout=300, **e2b["opts"]) as sbx:
        assert sbx.files.read("/home/user/work/made.txt") == "steps\nA"
        assert sbx.commands.run("test -f /etc/made-by-root && echo $STAGE").stdout == "steps\n"


def test_from_the_base_image_and_from_a_template(e2b, dockerfile_template):
    """E2B's base image is sandlot's `base` template; a template builds on another."""
    Template.build(Template().from_base_image().run_cmd("python --version > on-base.txt"),
                   "e2b-on-base", cpu_count=1, memory_mb=512, **e2b["opts"])
    layered = (Template().from_template("e2b-dockerfile")
               .run_cmd("cp /opt/app/hello.txt /home/user/copied.txt"))
    Template.build(layered, "e2b-layered", cpu_count=1, memory_mb=512, **e2b["opts"])
    with Sandbox.create("e2b-on-base", timeout=300, **e2b["opts"]) as sbx:
        assert sbx.files.read("/home/user/on-base.txt").startswith("Python 3")
    with Sandbox.create("e2b-layered", timeout=300, **e2b["opts"]) as sbx:
        assert sbx.files.read("/home/user/copied.txt") == "hello from the context\n"
        assert sbx.commands.run("echo $APP_MODE").stdout == "test\n"  # the parent's env


def test_a_failing_step_reports_its_output(e2b):
    template = (Template().from_image(e2b["image"])
                .run_cmd("echo fine")
                .run_cmd("echo boom-from-the-step >&2; exit 3"))
    logs: list[str] = []
    with pytest.raises(BuildException) as ei:
        Template.build(template, "e2b-failing", on_build_logs=lambda e: logs.append(
            str(e.message)), **e2b["opts"])
    assert "boom-from-the-step" in str(ei.value)
    assert any("boom-from-the-step" in line for line in logs)
    assert Template.exists("e2b-failing", **e2b["opts"]) is False


TASKS = Path(__file__).parent / "tasks"


def test_a_terminal_bench_style_task_end_to_end(e2b):
    """As a harness runs a task: build its environment's Dockerfile as a template, create a
    sandbox of it, upload and run the tests (failing before the agent worked), run the
    solution, run the tests again and read the reward the verifier wrote."""
    task = TASKS / "csv-sum"
    env_dir = task / "environment"
    # the tests have no internet: the task's base image comes from the loopback registry
    dockerfile = (env_dir / "Dockerfile").read_text().replace(
        "FROM debian:bookworm-slim", f"FROM {e2b['image']}")
    assert (task / "instruction.md").read_text().strip()
    template = Template(file_context_path=str(env_dir)).from_dockerfile(dockerfile)
    Template.build(template, "task-csv-sum", cpu_count=1, memory_mb=512, **e2b["opts"])

    def upload(sbx: Sandbox, folder: str) -> None:
        sbx.files.write_files([
            WriteEntry(path=f"/{folder}/{p.name}", data=p.read_text())
            for p in sorted((task / folder).iterdir())])

    def verify(sbx: Sandbox) -> float:
        run = sbx.commands.run("bash /tests/test.sh", user="root", timeout=60)
        assert run.exit_code == 0
        return float(sbx.files.read("/logs/verifier/reward.txt").strip())

    with Sandbox.create("task-csv-sum", timeout=300, **e2b["opts"]) as sbx:
        upload(sbx, "tests")
        with pytest.raises(CommandExitException):
            verify(sbx)
        assert sbx.files.read("/logs/verifier/reward.txt").strip() == "0"
        upload(sbx, "solution")
        sbx.commands.run("bash /solution/solve.sh", user="root", cwd="/app", timeout=120)
        assert verify(sbx) == 1.0


def test_start_command_runs_before_the_snapshot(e2b):
    """E2B's start and ready commands: the template's sandboxes start with the start command
    already running (it ran once, at the build, until the ready command succeeded)."""
    template = (Template().from_image(e2b["image"])
                .set_start_cmd("bash -c 'date +%s%N > /tmp/started-at; exec sleep infinity'",
                               wait_for_file("/tmp/started-at")))
    Template.build(template, "e2b-started", cpu_count=1, memory_mb=512, **e2b["opts"])
    seen = []
    for _ in range(2):
        with Sandbox.create("e2b-started", timeout=300, **e2b["opts"]) as sbx:
            seen.append(sbx.files.read("/tmp/started-at"))
            ps = sbx.commands.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert "sleep infinity" in ps.stdout
    assert seen[0] == seen[1]  # started once, at the build
