"""The TypeScript side: the `sandlot` npm package in sdk-ts/ (built, then its `node --test`
suite), the seeds' TypeScript scenarios in examples/ts/, and the unmodified `e2b` npm package in
tests/ts/e2b-js/, all against a real server and real VMs (the session `server` fixture).

`make setup` installs Node and the packages' dev dependencies (`npm ci`); these tests build the
SDK, its tests and the examples with them first, so they always run the current sources.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from sandlot import Sandbox, Snapshot

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "sdk-ts"
E2B_JS = Path(__file__).resolve().parent / "e2b-js"
EXAMPLES = sorted((ROOT / "examples" / "ts").glob("*.ts"))
NODE_TIMEOUT = 1800  # s: the whole VM suite, 100 MB round trip included, under TCG


def _node_env(**extra: str) -> dict[str, str]:
    """The environment minus any server settings a previous test left, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SANDLOT_", "E2B_"))}
    env["NODE_NO_WARNINGS"] = "1"
    return {**env, **extra}


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=NODE_TIMEOUT)


def _check(proc: subprocess.CompletedProcess, what: str) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{output[-20000:]}"
    return output


def _node_test(files: list[str], cwd: Path, env: dict[str, str]) -> dict[str, int]:
    """Run `node --test` on `files`; every test must pass and none be skipped."""
    proc = _run(["node", "--test", "--test-reporter=tap", *files], cwd, env)
    output = _check(proc, "node --test")
    print(output[-5000:])
    counts = {k: int(v) for k, v in re.findall(r"^# (\w+) (\d+)$", output, re.MULTILINE)}
    assert counts.get("pass", 0) > 0 and counts.get("fail", 0) == 0, counts
    assert counts.get("skipped", 0) == 0 and counts.get("cancelled", 0) == 0, counts
    return counts


@pytest.fixture(scope="module")
def built() -> Path:
    """sdk-ts built (dist/), with its tests (build/test/) and the examples (build/examples/)."""
    if shutil.which("node") is None or not (SDK / "node_modules").is_dir():
        pytest.fail("Node or sdk-ts/node_modules is missing: run `make setup`")
    for script in ("build", "build:test", "build:examples"):
        _check(_run(["npm", "run", "--silent", script], SDK, _node_env()), f"npm run {script}")
    return SDK


def test_sdk_without_a_server(built: Path) -> None:
    """Error mapping, configuration and stream parsing on a stub fetch; the REST types match
    openapi.yaml; `npm pack` installs into a separate project and loads with import and
    require."""
    _node_test(["build/test/unit.test.js", "build/test/openapi.test.js",
                "build/test/pack.test.js"], built, _node_env())


def test_sdk_against_a_server(built: Path, server) -> None:
    """Every call of the SDK on real VMs: sandboxes, commands, files (100 MB by streams),
    snapshots, restores, forks, rollbacks, and the errors the server answers with."""
    before = _listed(server)
    env = _node_env(SANDLOT_URL=server.url, SANDLOT_API_KEY=server.key)
    _node_test(["build/test/sandbox.test.js", "build/test/commands.test.js",
                "build/test/files.test.js", "build/test/snapshots.test.js"], built, env)
    assert _listed(server) == before, "the TypeScript tests left sandboxes or snapshots"


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example(built: Path, server, oci_images, script: Path) -> None:
    """Each seed scenario runs, exits 0 and leaves no sandbox or snapshot behind (the image
    ones with an image of the session's loopback registry)."""
    before = _listed(server)
    env = _node_env(SANDLOT_URL=server.url, SANDLOT_API_KEY=server.key,
                    SANDLOT_EXAMPLE_IMAGE=oci_images["debian"])
    output = _check(_run(["node", f"build/examples/{script.stem}.js"], built, env), script.name)
    print(output)
    assert _listed(server) == before, "the example left sandboxes or snapshots"


@pytest.mark.parametrize("suite", ["e2b.test.mjs", "e2b-as-e2b.test.mjs"])
def test_e2b_js_package(server, suite: str) -> None:
    """The unmodified `e2b` npm package, pointed at sandlot by E2B_API_URL, E2B_SANDBOX_URL
    and E2B_API_KEY only: its use (e2b.test.mjs), and what E2B clients rely on
    (e2b-as-e2b.test.mjs: listing order and pages, removing a missing path, symlinks,
    recursive watches, snapshot names, the default pause, a command stream cut by a kill)."""
    if not (E2B_JS / "node_modules" / "e2b").is_dir():
        pytest.fail("tests/ts/e2b-js/node_modules is missing: run `make setup`")
    before = _listed(server)
    env = _node_env(E2B_API_URL=f"{server.url}/e2b", E2B_SANDBOX_URL=f"{server.url}/e2b/envd",
                    E2B_API_KEY=server.key)
    _node_test([suite], E2B_JS, env)
    assert _listed(server)[0] == before[0], "the e2b tests left sandboxes"


def test_e2b_js_template_builds(server, oci_images) -> None:
    """The unmodified `e2b` npm package's Template builder (e2b-templates.test.mjs): a build
    with a copy and a run, a sandbox of it, exists, a failing step."""
    if not (E2B_JS / "node_modules" / "e2b").is_dir():
        pytest.fail("tests/ts/e2b-js/node_modules is missing: run `make setup`")
    env = _node_env(E2B_API_URL=f"{server.url}/e2b", E2B_SANDBOX_URL=f"{server.url}/e2b/envd",
                    E2B_API_KEY=server.key, E2B_TEST_IMAGE=oci_images["debian"])
    try:
        _node_test(["e2b-templates.test.mjs"], E2B_JS, env)
    finally:  # the images dir is shared: the template goes with its test
        httpx.delete(f"{server.url}/e2b/templates/e2b-js-template",
                     headers={"X-API-KEY": server.key})


def _listed(server) -> tuple[set[str], set[str]]:
    """The ids of the server's sandboxes and snapshots (pytest runs one test at a time)."""
    kw = server.client_kwargs()
    return ({s.sandbox_id for s in Sandbox.list(**kw)},
            {s.snapshot_id for s in Snapshot.list(**kw)})
