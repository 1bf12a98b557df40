"""Dockerfile builds, fast tier: a Dockerfile as template build steps, what is refused (by
line), and the REST routes' 4xx (the builds themselves:
tests/integrations/test_inspect_ai_eval.py)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from harness import tar_gz
from sandlot.errors import InvalidArgumentError
from sandlot.images import dockersteps
from sandlot.images.steps import Step
from sandlot.testing import in_process

HASH = "a" * 64


def test_a_dockerfile_becomes_steps() -> None:
    plan = dockersteps.convert(
        "ARG V=1\nFROM base AS build\n# a comment\nENV A=$V B=\"x y\" \\\n  C=${D:-d}\n"
        "COPY --chown=user --chmod=0755 a.txt b/ /opt/\nRUN echo $A > /opt/r\n"
        'RUN ["touch", "/opt/x y"]\nWORKDIR /opt\nUSER user\nCMD ["sleep", "1"]\n'
        "EXPOSE 80\n", HASH)
    assert plan.base == "base"
    assert plan.steps == [
        Step("USER", ("root",)), Step("WORKDIR", ("/",)),  # as Docker runs a Dockerfile
        Step("ENV", ("A", "1", "B", "x y", "C", "d")),
        Step("COPY", ("a.txt", "/opt/", "user", "0755"), HASH),
        Step("COPY", ("b/", "/opt/", "user", "0755"), HASH),
        Step("RUN", ("export V=1; echo $A > /opt/r",)),
        Step("RUN", ("export V=1; touch '/opt/x y'",)),
        Step("WORKDIR", ("/opt",)), Step("USER", ("user",))]
    assert [w.split(":")[0] for w in plan.warnings] == ["Dockerfile line 11",
                                                        "Dockerfile line 12"]
    plain = dockersteps.convert("FROM docker.io/library/alpine:3.20\nCOPY . /app\n", HASH)
    assert plain.base == "docker.io/library/alpine:3.20"
    assert plain.steps[-1] == Step("COPY", (".", "/app", "root", ""), HASH)


@pytest.mark.parametrize("text, words", [
    ("FROM base\nADD x /x\n", "line 2: ADD is not supported"),
    ("FROM base\nSHELL [\"/bin/bash\"]\n", "line 2: SHELL"),
    ("FROM base\nRUN true\nFROM base\n", "line 3: a second FROM"),
    ("FROM base\nCOPY --from=x a /a\n", "line 2: COPY --from"),
    ("FROM base\nRUN --mount=type=cache,target=/c true\n", "line 2: RUN flags"),
    ("FROM base\nCOPY a\n", "line 2: COPY SOURCE"),
    ("FROM base\nCOPY a b /c\n", "ending in /"),
    ("FROM base\nCOPY ../a /a\n", "outside the build context"),
    ("FROM base\nCOPY /etc/passwd /a\n", "outside the build context"),
    ("FROM base\nWORKDIR relative\n", "absolute"),
    ("FROM base\nUSER bad user!\n", "user name"),
    ("RUN true\n", "starts with FROM"),
    ("ARG X=1\n", "no FROM"),
    ("FROM a b\n", "line 1: FROM"),
    ("FROM base\nRUN a \\", "continuation"),
    ("FROM base\nCOPY 'a /a\n", "line 2: COPY"),
])
def test_what_sandlot_cannot_build_is_refused_by_line(text, words) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        dockersteps.convert(text, HASH)
    assert words in ei.value.message


def test_copy_needs_a_context() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a build context"):
        dockersteps.convert("FROM base\nCOPY a /a\n", None)


def _tar(files: dict[str, bytes]) -> str:
    return base64.b64encode(tar_gz(files)).decode()


async def test_rest_builds_answer_4xx(tmp_path) -> None:
    async with in_process(tmp_path) as srv:
        keys = {"a": srv.key, "b": await srv.add_key("b")}
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url) as c:
            async def call(method: str, path: str, who: str = "a", **kw) -> httpx.Response:
                return await c.request(method, path, headers={"x-api-key": keys[who]}, **kw)

            ok = {"dockerfile": "FROM base\nRUN true\n"}
            for name, body, status, words in (
                    ("t", {}, 400, ""),
                    ("t", {**ok, "extra": 1}, 400, ""),
                    ("Bad Name", ok, 400, "invalid template name"),
                    ("image-x", ok, 400, "sandlot's own"),
                    ("base", ok, 403, "not yours"),
                    ("t", {**ok, "cpus": 99}, 400, "cpuCount"),
                    ("t", {"dockerfile": "FROM base\nADD a /a\n"}, 400, "line 2: ADD"),
                    ("t", {"dockerfile": "FROM base\nCOPY a /a\n"}, 400, "build context"),
                    ("t", {**ok, "context": "not base64!"}, 400, "base64"),
                    ("t", {**ok, "context": base64.b64encode(b"not a tar").decode()}, 400,
                     "not a tar"),
                    ("t", {**ok, "context": _tar({"../x": b"1"})}, 400, ""),
                    ("t", {"dockerfile": "FROM NOT a ref\n"}, 400, "FROM"),
                    ("t", {"dockerfile": "FROM Not-A-Ref\n"}, 400, "reference"),
                    ("t", {"dockerfile": "FROM base\n" + "RUN x\n" * 600}, 400, "steps"),
                    ("t", {"dockerfile": "x" * (2 << 20)}, 4, "")):
                r = await call("POST", f"/v1/templates/{name}/builds", json=body)
                assert r.status_code // (100 if status == 4 else 1) == status, (name, r.text)
                assert words in r.text
            assert (await call("GET", "/v1/templates/t/builds/nope")).status_code == 404
            r = await call("POST", "/v1/templates/t/builds", json={
                **ok, "dockerfile": "FROM base\nCOPY a.txt /a.txt\n",
                "context": _tar({"a.txt": b"1"})})
            assert r.status_code == 202, r.text
            build = r.json()["build_id"]
            while (await call("GET", f"/v1/templates/t/builds/{build}")).json()["status"] \
                    not in ("ready", "error"):  # (the fake runtime runs no command)
                await asyncio.sleep(0.05)
            assert (await call("GET", f"/v1/templates/t/builds/{build}", who="b")
                    ).status_code == 404
            assert (await call("GET", f"/v1/templates/x/builds/{build}")).status_code == 404
            assert (await call("GET", f"/v1/templates/t/builds/{build}",
                               params={"logs_offset": -1})).status_code == 400


async def test_the_sdk_raises_the_failing_steps_output(tmp_path) -> None:
    """`templates.build` sends the Dockerfile's folder and waits; a failed step (the fake
    runtime runs no command) is a BuildStepError with the step's output."""
    from sandlot import AsyncSandlot
    from sandlot.errors import BuildStepError

    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "Dockerfile").write_text("FROM base\nCOPY a.txt /a.txt\nRUN true\n")
    (tmp_path / "env" / "a.txt").write_text("1")
    async with in_process(tmp_path / "srv") as srv:
        async with AsyncSandlot(srv.url, srv.key, transport=srv.async_transport()) as client:
            with pytest.raises(BuildStepError) as ei:
                await client.templates.build("t", dockerfile=tmp_path / "env" / "Dockerfile",
                                             timeout=60)
            assert "failed (exit" in ei.value.message
            with pytest.raises(InvalidArgumentError, match="line 2: ADD"):
                await client.templates.build("t", dockerfile="FROM base\nADD a /a\n")
