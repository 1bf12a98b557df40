"""A template built from an image in a registry that requires a login, with the unmodified
`e2b` SDK's `Template().from_image(ref, username=, password=)` (E2B's `fromImageRegistry`),
against a real server and real VMs: without the login (or with a wrong one) the build fails
saying so in its logs; with it the build succeeds; the login is used for that build's pull
only (kept nowhere, shown nowhere), and what it pulled is that tenant's alone. What the tests
built (and the template of the image they pulled) is deleted after them."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import subprocess
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

import imagekit
from harness import cleanup, e2b_tenant, make_server, secret_nowhere, tenant_key
from sandlot import testing

USER = "builder"
BUILT = ("e2b-private", "e2b-private-2", "e2b-pinned", "e2b-private-js")


@pytest.fixture(scope="module")
def private(tmp_path_factory, oci_images):
    """A registry that answers one login, holding a Debian test image under a digest of its
    own, and a server that may pull from it (and has no login for it)."""
    password = "pw-" + secrets.token_hex(8)
    registry = testing.RegistryServer(tmp_path_factory.mktemp("private-registry"),
                                      login=(USER, password))
    srv = make_server(tmp_path_factory.mktemp("private"), "priv")
    with contextlib.ExitStack() as stack:  # undone last to first
        stack.callback(registry.stop)
        stack.callback(cleanup, srv)
        registry.start()
        layout = imagekit.variant(imagekit.debian_layout(), tmp_path_factory.mktemp("img"),
                                  f"PRIVATE_IMAGE={secrets.token_hex(4)}")
        ref = imagekit.push(layout, registry, "team/private")
        manifest = subprocess.run(
            ["skopeo", "inspect", "--raw", "--tls-verify=false",
             f"--creds={USER}:{password}", f"docker://{ref}"],
            capture_output=True, check=True).stdout
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        srv.extra_env.update(registry.env)
        srv.start()
        opts = stack.enter_context(e2b_tenant(srv, "private", BUILT, registry.host))
        yield {"server": srv, "ref": ref, "password": password,
               "pinned": f"{registry.host}/team/private@{digest}", "opts": opts}


def failed_build(template: Template, name: str, opts: dict) -> tuple[str, list[str]]:
    logs: list[str] = []
    with pytest.raises(BuildException) as ei:
        Template.build(template, name, cpu_count=1, memory_mb=512,
                       on_build_logs=lambda e: logs.append(str(e.message)), **opts)
    return str(ei.value), logs


def test_a_build_pulls_with_its_own_login(private):
    ref, password, opts = private["ref"], private["password"], private["opts"]
    error, logs = failed_build(Template().from_image(ref).run_cmd("true"), "e2b-private",
                               opts)
    assert "credentials needed or wrong" in error
    assert any("credentials needed or wrong" in line for line in logs)
    error, _ = failed_build(Template().from_image(ref, username=USER, password="wrong")
                            .run_cmd("true"), "e2b-private", opts)
    assert "credentials needed or wrong" in error

    logs: list[str] = []
    template = (Template().from_image(ref, username=USER, password=password)
                .run_cmd("echo $PRIVATE_IMAGE > /home/user/private.txt"))
    Template.build(template, "e2b-private", cpu_count=1, memory_mb=512,
                   on_build_logs=lambda e: logs.append(str(e.message)), **opts)
    assert any("registry credentials" in line for line in logs)
    with Sandbox.create("e2b-private", timeout=300, **opts) as sbx:
        assert sbx.files.read("/home/user/private.txt").strip()

    # the login was for that build: a build without it is refused, the same image pinned by
    # its digest too, for this tenant and for another
    error, _ = failed_build(Template().from_image(ref).run_cmd("true"), "e2b-private-2",
                            opts)
    assert "credentials needed or wrong" in error
    other = {**opts, "api_key": tenant_key(private["server"], "others")}
    for who in (opts, other):
        error, _ = failed_build(Template().from_image(private["pinned"]).run_cmd("true"),
                                "e2b-pinned", who)
        assert "cannot pull" in error or "credentials" in error, error
    assert secret_nowhere(private["server"], password)


E2B_JS = Path(__file__).resolve().parents[1] / "ts" / "e2b-js"
JS_BUILD = """
const [major, minor] = process.versions.node.split(".").map(Number);
const { Template } = await import(major > 20 || (major === 20 && minor >= 19)
  ? "e2b" : "e2b/dist/index.mjs");
const login = { username: process.env.REG_USER, password: process.env.REG_PASSWORD };
const template = Template().fromImage(process.env.REG_IMAGE, login).runCmd("true");
try {
  await Template.build(template, "e2b-private-js", { cpuCount: 1, memoryMB: 512 });
  console.log("BUILT");
} catch (e) {
  console.log("FAILED " + e.message);
}
"""


def test_the_js_sdk_sends_the_login_too(private):
    """The e2b npm package's `fromImage(ref, {username, password})`: the same login."""
    if not (E2B_JS / "node_modules" / "e2b").is_dir():
        pytest.fail("tests/ts/e2b-js/node_modules is missing: run `make setup`")
    srv, opts = private["server"], private["opts"]

    def build(password: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDLOT_", "E2B_"))}
        env.update(NODE_NO_WARNINGS="1", E2B_API_URL=opts["api_url"],
                   E2B_SANDBOX_URL=opts["sandbox_url"], E2B_API_KEY=opts["api_key"],
                   REG_USER=USER, REG_PASSWORD=password, REG_IMAGE=private["ref"])
        out = subprocess.run(["node", "--input-type=module", "-e", JS_BUILD], cwd=E2B_JS,
                             env=env, capture_output=True, text=True, timeout=1200)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    assert "credentials needed or wrong" in build("wrong")
    assert "BUILT" in build(private["password"])
    assert secret_nowhere(srv, private["password"])
    with Sandbox.create("e2b-private-js", timeout=120, **opts) as sbx:
        assert sbx.commands.run("echo $PRIVATE_IMAGE").stdout.strip()
