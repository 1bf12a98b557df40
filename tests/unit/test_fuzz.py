"""A bounded schemathesis run over the REST API (`/openapi.json`) and the E2B API (its routes
are not in that document: `e2b_openapi` makes one of them) against a real HTTP server on the
fake runtime, in process: no answer is a 5xx (a 503 for capacity aside), no connection is
dropped, and the server logs no traceback (issue 22, item 4)."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from sandlot.guest.volserve import VolumeServer
from sandlot.runtime.fake import FakeRuntime
from sandlot.server.app import create_app
from sandlot.server.e2b import api as e2b_api
from sandlot.server.e2b import volume_content, volumes
from sandlot.testing import fake_settings, install_fake_template, loopback_socket

ST = Path(sys.executable).with_name("schemathesis")
EXAMPLES = 8


def e2b_openapi() -> dict:
    """An OpenAPI document of the E2B control-plane routes as sandlot serves them."""
    routes = []
    for route in [*e2b_api.router.routes, *volumes.router.routes,
                  *volume_content.router.routes]:
        if isinstance(route, APIRoute) and "{rest" not in route.path:
            shown = copy.copy(route)
            shown.include_in_schema = True
            routes.append(shown)
    return get_openapi(title="sandlot e2b", version="1", routes=routes)


class Tracebacks(logging.Handler):
    """Every log record with an exception or at ERROR: what must not happen."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(self.format(record))


@pytest.fixture
def http_server(tmp_path):
    """The app on the fake runtime behind uvicorn on a loopback port, in a thread."""
    key = "sl_fuzz_key"
    runtime = FakeRuntime()
    runtime.volumes = VolumeServer(tmp_path / "srv" / "volumes", b"k" * 32)
    settings = fake_settings(tmp_path / "srv", api_key=key,  # an admin key the server adds
                             registries="registry.invalid")  # no pull reaches the network
    install_fake_template(settings, runtime)
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, runtime=runtime),
                                           log_config=None, loop="asyncio",
                                           timeout_graceful_shutdown=5))
    caught = Tracebacks()
    logging.getLogger().addHandler(caught)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", key, caught
    server.should_exit = True
    thread.join(30)
    logging.getLogger().removeHandler(caught)


def run(schema: str, url: str, key: str, out: Path, params: dict[str, str] | None = None,
        examples: int = EXAMPLES) -> list[dict]:
    """schemathesis over `schema` (a URL or a file), with `params` fixed (``path.NAME``); the
    HAR entries of every request. An event stream (/v1/events) is read up to its first event
    (`ready`, sent at once): it never ends, and read to the request timeout each of its cases
    took 20 s."""
    out.mkdir(parents=True, exist_ok=True)
    config = "max-stream-events = 1\n"
    if params:
        config += "[parameters]\n" + "".join(
            f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in params.items())
    (out / "schemathesis.toml").write_text(config)
    cmd = [str(ST), "--config-file", str(out / "schemathesis.toml"), "run", schema,
           "--url", url, "-H", f"Authorization: Bearer {key}", "-H", f"X-API-Key: {key}",
           "-c", "not_a_server_error", "-n", str(examples),
           "--request-timeout", "20", "--seed", "22", "-w", "1", "--no-color",
           "--generation-database", "none", "--report", "har",
           "--report-har-path", str(out / "har.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=300)
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert (out / "har.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    entries = json.loads((out / "har.json").read_text())["log"]["entries"]
    assert entries, proc.stdout[-3000:]
    for dropped in ("Network Error", "Connection aborted", "ConnectionError",
                    "Unresponsive Operation"):  # the server closed or never answered
        assert dropped not in proc.stdout, proc.stdout[-3000:]
    return entries


def server_errors(entries: list[dict]) -> list[str]:
    bad = []
    for e in entries:
        status, text = e["response"]["status"], (e["response"].get("content") or {}).get(
            "text", "")
        if status == 503 and "CapacityError" in text:
            continue  # no room: what the host says when it is full
        if status == 501 and "/e2b/" in e["request"]["url"]:
            continue  # an E2B call sandlot does not serve (docs/e2b.md)
        if status >= 500:
            req = e["request"]
            body = (req.get("postData") or {}).get("text", "")[:300]
            bad.append(f"{status} {req['method']} {req['url'][:200]} {body!r}: {text[:300]}")
    return bad


@pytest.mark.skipif(not ST.exists(), reason="schemathesis is not installed (the test extra)")
def test_schemathesis_finds_no_server_error(http_server, tmp_path) -> None:
    url, key, caught = http_server
    (tmp_path / "e2b.json").write_text(json.dumps(e2b_openapi()))
    rest = run(f"{url}/openapi.json", url, key, tmp_path / "rest")
    e2b = run(str(tmp_path / "e2b.json"), url, key, tmp_path / "e2b")
    # again, on a live sandbox and a ready snapshot (generated ids mostly meet a 404)
    auth = {"authorization": f"Bearer {key}"}
    sandbox_id = httpx.post(f"{url}/v1/sandboxes", json={}, headers=auth).json()["sandbox_id"]
    snap = httpx.post(f"{url}/v1/sandboxes/{sandbox_id}/snapshots", json={}, headers=auth)
    params = {"path.sandbox_id": sandbox_id, "path.id_or_name": snap.json()["snapshot_id"]}
    live = run(f"{url}/openapi.json", url, key, tmp_path / "rest-live", params, 4)
    volume = httpx.post(f"{url}/e2b/volumes", json={"name": "fuzz"}, headers=auth)
    live += run(str(tmp_path / "e2b.json"), url, key, tmp_path / "e2b-live",
                {"path.sandbox_id": sandbox_id, "path.volume_id": volume.json()["volumeID"]},
                4)
    answers = rest + e2b + live
    assert 0 not in {e["response"]["status"] for e in answers}  # a dropped connection
    assert not server_errors(answers), "\n".join(server_errors(answers))
    assert not caught.records, "\n\n".join(caught.records[:5])
    assert len(rest) > 100 and len(e2b) > 50 and len(live) > 50, (len(rest), len(e2b))
    shutil.rmtree(tmp_path / "srv", ignore_errors=True)
