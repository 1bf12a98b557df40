"""Templates built from images in AWS's and GCP's registries with the unmodified `e2b` SDK's
`Template().from_aws_registry(...)` and `from_gcp_registry(...)` (E2B's `fromImageRegistry`
types `aws` and `gcp`), against a real server, real VMs and a real registry on loopback that
requires a login: GCP's service account key is the login `_json_key` (the key file as its
password, as Artifact Registry and GCR take it); an AWS access key is turned into the login
`AWS` / token by ECR's `GetAuthorizationToken`, called by the server on a real ECR-API-speaking
server on loopback (moto's, `SANDLOT_ECR_ENDPOINT`) that checks the key's signature. A wrong
key file, wrong keys and an ECR API that does not answer fail with the reason. One build per
registry type; what the tests built is deleted after them."""

from __future__ import annotations

import contextlib
import json
import secrets

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

import imagekit
from harness import cleanup, e2b_tenant, make_server, secret_nowhere
from sandlot import testing

BUILT = ("e2b-gcp", "e2b-aws", "e2b-cloud-fails")


def service_account(key_id: str) -> dict:
    """A service account's JSON key (its fields in a key file's order, `private_key_id`
    first: the test registry's bcrypt reads a password's first 72 bytes)."""
    return {"private_key_id": key_id, "type": "service_account", "project_id": "sandlot-test",
            "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQ\n-----END PRIVATE KEY-----\n",
            "client_email": "puller@sandlot-test.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": "https://oauth2.googleapis.com/token"}


@pytest.fixture(scope="module")
def clouds(tmp_path_factory, oci_images):
    """A registry answering an ECR token's login (AWS / moto's token) and a GCP key's
    (`_json_key` / the key), holding a Debian test image; moto's server, whose IAM knows one
    access key; a sandlot server whose ECR API is moto's."""
    moto = testing.EcrServer(tmp_path_factory.mktemp("moto"))
    gcp_key = service_account(secrets.token_hex(20))
    registry = testing.RegistryServer(
        tmp_path_factory.mktemp("cloud-registry"), login=("AWS", moto.password),
        more_logins=(("_json_key", json.dumps(gcp_key)),))
    srv = make_server(tmp_path_factory.mktemp("clouds"), "cloud")
    with contextlib.ExitStack() as stack:  # undone last to first
        stack.callback(moto.stop)
        stack.callback(registry.stop)
        stack.callback(cleanup, srv)
        moto.start()
        registry.start()
        access_key, secret = moto.require_keys()
        layout = imagekit.variant(imagekit.debian_layout(), tmp_path_factory.mktemp("img"),
                                  f"CLOUD_IMAGE={secrets.token_hex(4)}")
        ref = imagekit.push(layout, registry, "team/cloud")
        srv.extra_env.update({**registry.env, "SANDLOT_ECR_ENDPOINT": moto.url})
        srv.start()
        opts = stack.enter_context(e2b_tenant(srv, "clouds", BUILT, registry.host))
        yield {"server": srv, "ref": ref, "moto": moto, "gcp_key": gcp_key,
               "aws": {"access_key_id": access_key, "secret_access_key": secret,
                       "region": "us-east-1"},
               "opts": opts}


def build(template: Template, name: str, opts: dict) -> list[str]:
    logs: list[str] = []
    Template.build(template, name, cpu_count=1, memory_mb=512,
                   on_build_logs=lambda e: logs.append(str(e.message)), **opts)
    return logs


def failed_build(template: Template, opts: dict) -> str:
    with pytest.raises(BuildException) as ei:
        build(template, "e2b-cloud-fails", opts)
    return str(ei.value)


def test_a_gcp_build_pulls_with_its_json_key(clouds, tmp_path):
    ref, opts, key = clouds["ref"], clouds["opts"], clouds["gcp_key"]
    error = failed_build(Template().from_gcp_registry(ref, service_account_json={
        "type": "authorized_user", "client_id": "x"}).run_cmd("true"), opts)
    assert "400" in error and "not a service account's JSON key" in error
    other = {**key, "private_key_id": secrets.token_hex(20)}  # another account's key
    error = failed_build(Template().from_gcp_registry(ref, service_account_json=other)
                         .run_cmd("true"), opts)
    assert "credentials needed or wrong" in error

    key_file = tmp_path / "key.json"  # the SDK reads a path as the key file
    key_file.write_text(json.dumps(key) + "\n")
    logs = build(Template().from_gcp_registry(ref, service_account_json=str(key_file))
                 .run_cmd("echo $CLOUD_IMAGE > /home/user/cloud.txt"), "e2b-gcp", opts)
    assert any("registry credentials" in line for line in logs)
    with Sandbox.create("e2b-gcp", timeout=300, **opts) as sbx:
        assert sbx.files.read("/home/user/cloud.txt").strip()
    assert secret_nowhere(clouds["server"], key["private_key_id"])


def test_an_aws_build_gets_its_login_from_ecr(clouds):
    ref, opts, aws = clouds["ref"], clouds["opts"], clouds["aws"]
    error = failed_build(Template().from_aws_registry(ref, **{**aws, "region": "mars-1"})
                         .run_cmd("true"), opts)
    assert "400" in error and "not an AWS region name" in error
    error = failed_build(Template().from_aws_registry(
        ref, **{**aws, "secret_access_key": "wrong" + aws["secret_access_key"]})
        .run_cmd("true"), opts)
    assert "refused the access key: SignatureDoesNotMatch" in error

    logs = build(Template().from_aws_registry(ref, **aws).run_cmd("true"), "e2b-aws", opts)
    assert any("asking ECR (region us-east-1)" in line for line in logs)
    assert any("registry credentials" in line for line in logs)
    assert Template.exists("e2b-aws", **opts)
    assert secret_nowhere(clouds["server"], aws["secret_access_key"])
    assert secret_nowhere(clouds["server"], clouds["moto"].password)

    clouds["moto"].stop()  # ECR's API gone: the build fails saying so
    error = failed_build(Template().from_aws_registry(ref, **aws).run_cmd("true"), opts)
    assert "ECR's API (region us-east-1) could not be reached" in error
