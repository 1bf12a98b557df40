"""Pause and resume of a real VM: the state comes back under the same id; pausing a paused
sandbox is refused with 409 InvalidStateError (issue #16: it answered 404)."""

from __future__ import annotations

import httpx
import pytest

from sandlot import InvalidStateError


def test_pausing_a_paused_sandbox_is_a_409_with_a_message(server, sandbox_factory):
    sbx = sandbox_factory()
    sbx.commands.run("echo kept > /root/state", check=True)
    sbx.pause()
    assert sbx.get_info().state == "paused"
    with pytest.raises(InvalidStateError, match="already paused"):
        sbx.pause()
    r = httpx.post(f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/pause",
                   headers={"authorization": f"Bearer {server.key}"}, timeout=60)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["type"] == "InvalidStateError"
    assert "already paused" in r.json()["error"]["message"]
    sbx.resume()
    assert sbx.commands.run("cat /root/state").stdout == "kept\n"
    # Paused once more after the resume; a killed one is still not found.
    sbx.pause()
    sbx.kill()
    r = httpx.post(f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/pause",
                   headers={"authorization": f"Bearer {server.key}"}, timeout=60)
    assert r.status_code == 404, r.text
