"""The console's tree at a few hundred nodes, in a real headless browser: every node drawn
(none on top of another), a fold hides what came from a snapshot, and a new sandbox joins the
drawn tree live. The records come from a server on the fake machine layer (uvicorn on a
loopback port this test binds), since what is checked is the drawing, not the VMs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from playwright.sync_api import expect
from test_console import WAIT, browser  # noqa: F401 - the shared browser fixture

from sandlot.runtime.fake import FakeRuntime
from sandlot.server.app import create_app
from sandlot.testing import fake_settings, install_fake_template

ROOTS, RESTORES = 60, 3  # 1 template + 60 sandboxes + 60 snapshots + 180 restores = 301 nodes
KEY = "sl_console_scale_key"


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory) -> Iterator[str]:
    runtime = FakeRuntime()
    settings = fake_settings(tmp_path_factory.mktemp("scale"), api_key=KEY,
                             max_sandboxes=1000)
    install_fake_template(settings, runtime)
    server = uvicorn.Server(uvicorn.Config(create_app(settings, runtime=runtime),
                                           host="127.0.0.1", port=0, log_config=None,
                                           loop="asyncio", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def make_tree(url: str) -> list[str]:
    """ROOTS sandboxes, a snapshot of each, RESTORES restores of each snapshot; the snapshot
    ids."""
    snaps = []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        for _ in range(ROOTS):
            sid = c.post("/v1/sandboxes", json={}).raise_for_status().json()[
                "sandbox_id"]
            snap = c.post(f"/v1/sandboxes/{sid}/snapshots", json={}).raise_for_status().json()
            c.post(f"/v1/snapshots/{snap['snapshot_id']}/wait").raise_for_status()
            snaps.append(snap["snapshot_id"])
            for _ in range(RESTORES):
                c.post("/v1/sandboxes",
                       json={"snapshot_id": snap["snapshot_id"]}).raise_for_status()
    return snaps


def test_a_tree_of_three_hundred_nodes_is_drawn_folded_and_kept_live(browser,  # noqa: F811
                                                                      fake_server) -> None:
    snaps = make_tree(fake_server)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(WAIT)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{fake_server}/console/")
    page.fill("#key", KEY)
    page.click("#login button[type=submit]")
    expect(page.locator("#live.on")).to_be_visible()
    page.click("nav a[href='#/tree']")
    total = 1 + ROOTS * (2 + RESTORES)
    at_least = "n => window.sandlotTree && sandlotTree.nodes().length >= n"  # a function: CSP
    page.wait_for_function(at_least, arg=total)
    # laid out: no two nodes' boxes overlap
    overlaps = page.evaluate("""() => {
        const boxes = sandlotTree.nodes().map(n => n.boundingBox());
        let overlaps = 0;
        for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
            const a = boxes[i], b = boxes[j];
            if (a.x1 < b.x2 && b.x1 < a.x2 && a.y1 < b.y2 && b.y1 < a.y2) overlaps++;
        }
        return overlaps;
    }""")
    assert overlaps == 0
    # a fold (double click) hides what came from a snapshot, and unfolds again
    node = f"n:{snaps[0]}"
    visible = f"sandlotTree.getElementById('{node}').successors('node').filter(':visible').length"
    assert page.evaluate(visible) == RESTORES
    page.evaluate(f"sandlotTree.getElementById('{node}').emit('dbltap') && null")
    assert page.evaluate(visible) == 0
    page.evaluate(f"sandlotTree.getElementById('{node}').emit('dbltap') && null")
    assert page.evaluate(visible) == RESTORES
    # zoom: Fit shows the whole tree; the view can zoom back in to read a node
    page.click("#fit")
    assert page.evaluate("sandlotTree.extent().w >= sandlotTree.elements().boundingBox().w - 1")
    # (`&& null`: an evaluate answers nothing, not a cytoscape object to serialize)
    page.evaluate("sandlotTree.zoom({level: 1.5, position: sandlotTree.nodes()[0].position()})"
                  " && null")
    assert page.evaluate("sandlotTree.zoom()") == 1.5
    # live: one more restore joins the drawn tree without a reload
    with httpx.Client(base_url=fake_server, headers={"authorization": f"Bearer {KEY}"}) as c:
        c.post("/v1/sandboxes", json={"snapshot_id": snaps[1]}).raise_for_status()
    page.wait_for_function(at_least, arg=total + 1)
    assert errors == []
