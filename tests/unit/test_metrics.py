"""Metrics: each sandbox's use sampled from the host (sandlot's API and E2B's shape), and
Prometheus' text at /metrics."""

from __future__ import annotations

from sandlot.testing import in_process


async def test_sandbox_metrics_and_prometheus(tmp_path) -> None:
    import httpx

    async with in_process(tmp_path) as srv, httpx.AsyncClient(
            transport=srv.async_transport(), base_url="http://sandlot.test",
            headers={"authorization": f"Bearer {srv.key}", "x-api-key": srv.key}) as api:
        sid = (await api.post("/v1/sandboxes", json={})).json()["sandbox_id"]
        samples = (await api.get(f"/v1/sandboxes/{sid}/metrics")).json()["metrics"]
        assert samples and samples[0]["mem_total"] == 512 << 20 and samples[0]["cpu_count"] == 1
        e2b = (await api.get(f"/e2b/sandboxes/{sid}/metrics")).json()
        assert set(e2b[0]) >= {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct",
                               "memUsed", "memTotal", "diskUsed", "diskTotal"}
        later = (await api.get(f"/v1/sandboxes/{sid}/metrics",
                               params={"start": samples[0]["timestamp"] + 3600})).json()
        assert later["metrics"] == []
        bad = await api.get(f"/v1/sandboxes/{sid}/metrics", params={"start": 10, "end": 5})
        assert bad.status_code == 400
        assert (await api.get("/v1/sandboxes/sb-none/metrics")).status_code == 404
        assert (await api.get("/e2b/sandboxes/sb-none/metrics")).status_code == 404
        text = (await api.get("/metrics")).text
        assert 'sandlot_sandboxes{state="running"} 1.0' in text
        assert 'sandlot_operation_seconds_count{operation="create"} 1.0' in text
        assert "sandlot_host_free_slots" in text and "sandlot_store_snapshot_bytes" in text
