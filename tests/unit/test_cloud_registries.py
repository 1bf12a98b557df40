"""E2B's AWS and GCP registry types (``fromImageRegistry`` ``aws``, ``gcp``), fast tier: what
the server accepts of them, where its ECR call may go, and that call against a real
ECR-API-speaking server on loopback (moto's): the token, refused keys, an endpoint that does
not answer (the builds themselves: tests/e2b/test_e2b_cloud_registries.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from sandlot.errors import ImageError, InvalidArgumentError
from sandlot.images import ecr
from sandlot.server.e2b.templates import _login
from sandlot.testing import EcrServer, in_process

KEY = {"type": "service_account", "project_id": "p", "private_key_id": "k",
       "private_key": "-----BEGIN PRIVATE KEY-----\nMII\n-----END PRIVATE KEY-----\n",
       "client_email": "puller@p.iam.gserviceaccount.com"}


def test_a_gcp_key_is_the_json_key_login() -> None:
    text = json.dumps(KEY, indent=2) + "\n"
    login = _login({"type": "gcp", "serviceAccountJson": text})
    assert login.username == "_json_key" and login.password == text.rstrip("\n")
    assert "BEGIN" not in repr(login)
    for bad, words in ((None, "needs serviceAccountJson"), ("", "needs serviceAccountJson"),
                       ("{not json", "not JSON"), ("[1]", "not a service account"),
                       (json.dumps({**KEY, "type": "authorized_user"}), "not a service"),
                       (json.dumps({k: v for k, v in KEY.items() if k != "private_key"}),
                        "private_key"),
                       (json.dumps({**KEY, "pad": "x" * 20000}), "over 16384")):
        with pytest.raises(InvalidArgumentError) as ei:
            _login({"type": "gcp", "serviceAccountJson": bad})
        assert words in ei.value.message, (bad, ei.value.message)


def test_aws_keys_are_checked_and_kept_out_of_reprs() -> None:
    keys = _login({"type": "aws", "awsAccessKeyId": "AKIAEXAMPLE",
                   "awsSecretAccessKey": "s3cr3t/+x", "awsRegion": "eu-west-3"})
    assert keys == ecr.Keys("AKIAEXAMPLE", "s3cr3t/+x", "eu-west-3")
    assert "s3cr3t" not in repr(keys)
    good = {"awsAccessKeyId": "AKIA1", "awsSecretAccessKey": "s", "awsRegion": "us-east-1"}
    for field, value, words in (("awsAccessKeyId", None, "awsAccessKeyId"),
                                ("awsAccessKeyId", "AKIA/../x", "awsAccessKeyId"),
                                ("awsSecretAccessKey", "", "awsSecretAccessKey"),
                                ("awsSecretAccessKey", "a\nb", "awsSecretAccessKey"),
                                ("awsSecretAccessKey", "x" * 300, "awsSecretAccessKey"),
                                ("awsRegion", None, "awsRegion"),
                                ("awsRegion", "us-east-1.evil.example", "not an AWS region"),
                                ("awsRegion", "127.0.0.1:80/", "not an AWS region"),
                                ("awsRegion", "US-EAST-1", "not an AWS region")):
        with pytest.raises(InvalidArgumentError) as ei:
            _login({"type": "aws", **good, field: value})
        assert words in ei.value.message


def test_the_ecr_call_goes_to_aws_or_the_operators_endpoint_only() -> None:
    assert ecr.endpoint("us-east-1") == "https://api.ecr.us-east-1.amazonaws.com"
    assert ecr.endpoint("us-gov-west-1") == "https://api.ecr.us-gov-west-1.amazonaws.com"
    assert ecr.endpoint("cn-north-1") == "https://api.ecr.cn-north-1.amazonaws.com.cn"
    assert ecr.endpoint("us-east-1", "https://vpce.example/") == "https://vpce.example"
    for region in ("evil.example#", "x", "us-east-1/../", "a-b-1.attacker.example"):
        with pytest.raises(InvalidArgumentError):
            ecr.endpoint(region)


def test_the_ecr_endpoint_setting_is_an_url(monkeypatch) -> None:
    from sandlot.config import Settings

    monkeypatch.setenv("SANDLOT_ECR_ENDPOINT", "http://127.0.0.1:4566")
    assert Settings.from_env().ecr_endpoint == "http://127.0.0.1:4566"
    monkeypatch.setenv("SANDLOT_ECR_ENDPOINT", "127.0.0.1:4566")
    with pytest.raises(InvalidArgumentError, match="SANDLOT_ECR_ENDPOINT"):
        Settings.from_env()
    monkeypatch.delenv("SANDLOT_ECR_ENDPOINT")
    assert Settings.from_env().ecr_endpoint is None


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = EcrServer(tmp_path_factory.mktemp("moto"))
    server.start()
    yield server
    server.stop()


async def test_ecr_gives_a_login_for_good_keys_only(moto) -> None:
    key_id, secret = moto.require_keys()
    assert await ecr.login(ecr.Keys(key_id, secret, "us-east-1"), moto.url) \
        == ("AWS", moto.password)
    with pytest.raises(ImageError, match="refused the access key: SignatureDoesNotMatch"):
        await ecr.login(ecr.Keys(key_id, "wrong", "us-east-1"), moto.url)
    with pytest.raises(ImageError, match="refused the access key: InvalidClientTokenId"):
        await ecr.login(ecr.Keys("AKIANOBODY", secret, "us-east-1"), moto.url)


async def test_an_ecr_endpoint_that_does_not_answer_fails_clearly(tmp_path) -> None:
    keys = ecr.Keys("AKIA1", "s", "us-east-1")
    with pytest.raises(ImageError, match=r"region us-east-1\) could not be reached"):
        await ecr.login(keys, "http://127.0.0.1:1")

    real = httpx.AsyncClient
    token = base64.b64encode(b"no-colon").decode()
    for status, body, words in (
            (500, b"", "answered 500"), (200, b"{}", "without an authorization token"),
            (200, b"not json", "without an authorization token"),
            (200, json.dumps({"authorizationData": [{"authorizationToken": token}]}).encode(),
             "not a login")):
        transport = httpx.MockTransport(lambda _, s=status, b=body: httpx.Response(s, content=b))

        def client(*a, transport=transport, **kw):
            return real(*a, transport=transport, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ecr.httpx, "AsyncClient", client)
            with pytest.raises(ImageError, match=words):
                await ecr.login(keys, "http://ecr.test")


async def test_a_build_whose_ecr_login_fails_says_so(tmp_path) -> None:
    """Through the API: the build is accepted, then fails with the ECR call's reason (before
    any pull or sandbox); the keys are in neither its logs nor its status."""
    async with in_process(tmp_path, ecr_endpoint="http://127.0.0.1:1") as srv:
        async with httpx.AsyncClient(transport=srv.async_transport(),
                                     base_url=srv.url) as client:
            headers = {"x-api-key": srv.key}
            made = (await client.post("/e2b/v3/templates", json={"name": "from-ecr"},
                                      headers=headers)).json()
            build = f"/e2b/templates/from-ecr/builds/{made['buildID']}"
            r = await client.post(f"/e2b/v2{build[4:]}", headers=headers, json={
                "fromImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/app:1",
                "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "AKIA1",
                                      "awsSecretAccessKey": "very-secret",
                                      "awsRegion": "us-east-1"}, "steps": []})
            assert r.status_code == 202, r.text
            for _ in range(200):
                status = (await client.get(build + "/status", headers=headers)).json()
                if status["status"] not in ("waiting", "building"):
                    break
                await asyncio.sleep(0.05)
            assert status["status"] == "error", status
            assert "could not be reached" in status["reason"]["message"]
            assert "very-secret" not in json.dumps(status)

