"""E2B's volume routes on the fake runtime (what they answer, not the mount: that is
tests/e2b/test_e2b_volumes.py on real VMs): records per tenant, names unique within one,
clear 4xx for bad input, volumeMounts resolved before a sandbox starts."""

from __future__ import annotations

import httpx
import pytest

from sandlot.guest.volserve import VolumeServer
from sandlot.runtime.fake import FakeRuntime
from sandlot.testing import in_process


@pytest.fixture
async def api(tmp_path):
    runtime = FakeRuntime()
    runtime.volumes = VolumeServer(tmp_path / "vols", b"k" * 32)
    async with in_process(tmp_path, runtime=runtime) as srv:
        other = await srv.add_key("other")
        base = f"{srv.url}/e2b"
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=base,
                                     headers={"X-API-KEY": srv.key}) as a, \
                httpx.AsyncClient(transport=srv.async_transport(), base_url=base,
                                  headers={"X-API-KEY": other}) as b:
            yield srv, a, b


async def test_volume_records(api, tmp_path) -> None:
    srv, a, b = api
    r = await a.post("/volumes", json={"name": "data"})
    assert r.status_code == 201, r.text
    vol = r.json()
    assert set(vol) == {"volumeID", "name", "token"} and vol["name"] == "data"
    assert (tmp_path / "vols" / vol["volumeID"]).is_dir()
    assert (await a.get("/volumes")).json() == [{"volumeID": vol["volumeID"], "name": "data"}]
    assert (await a.get(f"/volumes/{vol['volumeID']}")).json() == vol
    assert (await a.get("/volumes/data")).json() == vol
    r = await a.post("/volumes", json={"name": "data"})
    assert r.status_code == 409 and "exists already" in r.json()["message"]
    for bad in ({"name": ""}, {"name": "a b"}, {"name": "x" * 64}, {}, {"name": 5}):
        r = await a.post("/volumes", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["message"]

    # another tenant
    assert (await b.get("/volumes")).json() == []
    theirs = await b.get(f"/volumes/{vol['volumeID']}")
    missing = await b.get("/volumes/vol-000000000000")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.text.replace(vol["volumeID"], "<id>") \
        == missing.text.replace("vol-000000000000", "<id>")  # as a missing one
    assert (await b.delete(f"/volumes/{vol['volumeID']}")).status_code == 404
    assert (await b.post("/volumes", json={"name": "data"})).status_code == 201

    assert (await a.delete(f"/volumes/{vol['volumeID']}")).status_code == 204
    assert not (tmp_path / "vols" / vol["volumeID"]).exists()
    assert (await a.get(f"/volumes/{vol['volumeID']}")).status_code == 404
    r = await a.get("/volumecontent/x/dir")  # served: test_e2b_volume_content.py
    assert r.status_code == 400 and "path" in r.json()["message"]


async def test_volume_mounts_on_create(api) -> None:
    srv, a, b = api
    vol = (await a.post("/volumes", json={"name": "data"})).json()

    async def create(client, mounts) -> httpx.Response:
        return await client.post("/sandboxes", json={"templateID": "base",
                                                     "volumeMounts": mounts})

    r = await create(a, [{"name": "data", "path": "/mnt/data"}])
    assert r.status_code == 201, r.text
    vm = srv.runtime.vms[r.json()["sandboxID"]]
    assert vm.agent.state.mounts == {"/mnt/data": srv.runtime.volumes.token(vol["volumeID"])}
    before = len(srv.runtime.vms)
    for client, mounts, status in (
            (b, [{"name": "data", "path": "/mnt/data"}], 404),
            (a, [{"name": "nope", "path": "/mnt/data"}], 404),
            (a, [{"name": "data", "path": "relative"}], 400),
            (a, [{"name": "data", "path": "/mnt/../etc"}], 400),
            (a, [{"name": "data", "path": "/etc"}], 400),
            (a, [{"name": "data", "path": "/a"}, {"name": "data", "path": "/a"}], 400),
            (a, [{"name": "data"}], 400),
            (a, ["data"], 400)):
        r = await create(client, mounts)
        assert r.status_code == status, (mounts, r.text)
        assert r.json()["message"]
    assert len(srv.runtime.vms) == before, "a refused mount starts no VM"
