"""The web console (/console) in a real headless browser: Debian's chromium driven by
Playwright, against the session's sandlot server and real VMs. The screenshots these tests
take are docs/console.md's (with SANDLOT_SCREENSHOTS=docs/console)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from sandlot import Sandbox

CHROMIUM = Path("/usr/bin/chromium")  # Debian's (scripts/setup.sh); no browser is downloaded
# docs/console.md's screenshots: refreshed with SANDLOT_SCREENSHOTS=docs/console; otherwise
# taken (so the pages are drawn) into a directory that goes away with the run
SHOTS = Path(os.environ.get("SANDLOT_SCREENSHOTS")
             or tempfile.mkdtemp(prefix="sandlot-console-shots-"))
WAIT = 180_000  # ms: a bound on waits for VMs under TCG, not a speed


@pytest.fixture(scope="module", autouse=True)
def _screenshots() -> Iterator[None]:
    yield
    if not os.environ.get("SANDLOT_SCREENSHOTS"):
        shutil.rmtree(SHOTS, ignore_errors=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed: run `make setup`")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def keys(server) -> dict[str, str]:
    """Keys of two tenants, made as an operator makes them (`sandlot keys create`)."""
    def create(tenant: str) -> str:
        out = subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "create", "--tenant",
                              tenant, "--data-dir", str(server.data_dir)], env=server.env,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    return {"a": create("console-a"), "b": create("console-b")}


@pytest.fixture
def made(server) -> Iterator[list[Sandbox]]:
    """Sandboxes a test makes through the SDK (with any key): killed after it."""
    boxes: list[Sandbox] = []
    yield boxes
    for box in boxes:
        try:
            box.kill()
        except Exception:  # noqa: BLE001 - cleanup best effort
            pass


def open_console(browser: Browser, server, key: str) -> Page:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(WAIT)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.console_errors = errors  # type: ignore[attr-defined]
    page.goto(f"{server.url}/console/")
    page.fill("#key", key)
    page.click("#login button[type=submit]")
    expect(page.locator("#live.on")).to_be_visible()  # signed in, the event stream open
    return page


def new_sandbox(server, key: str, made: list[Sandbox]) -> Sandbox:
    box = Sandbox.create(timeout=900, api_url=server.url, api_key=key)
    made.append(box)
    return box


def test_a_wrong_key_is_refused_with_the_apis_words(browser, server) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{server.url}/console/")
    page.fill("#key", "sl_not_a_key")
    page.click("#login button[type=submit]")
    expect(page.locator("#login-error")).to_have_text("invalid API key")
    expect(page.locator("nav")).to_have_count(0)
    assert page.evaluate("sessionStorage.getItem('sandlot.key')") is None
    assert "sl_not_a_key" not in page.url
    page.screenshot(path=SHOTS / "sign-in.png")
    page.close()


def printed(page: Page, text: str) -> None:
    """Wait until the terminal shows `text` on some line."""
    page.wait_for_function("""text => {
        const b = window.sandlotTerminal.buffer.active;
        for (let i = 0; i < b.length; i++)
            if ((b.getLine(i)?.translateToString() ?? '').includes(text)) return true;
        return false; }""", arg=text)


def test_a_new_sandbox_appears_live_and_its_terminal_runs_commands(browser, server, keys,
                                                                    made, tmp_path) -> None:
    page = open_console(browser, server, keys["a"])
    box = new_sandbox(server, keys["a"], made)  # through the SDK, the page not reloaded
    row = page.locator(f"#sandboxes tr[data-id='{box.sandbox_id}']")
    expect(row).to_have_attribute("data-state", "running")
    expect(row).to_contain_text("template base")
    page.screenshot(path=SHOTS / "sandboxes.png")

    row.locator("a").click()
    expect(page.locator("#terminal-status")).to_have_text(re.compile(r"^shell \d+$"))
    page.wait_for_function("""() => {  // the shell's prompt, as a user waits for it
        const b = window.sandlotTerminal.buffer.active;
        return /[#$] *$/.test(b.getLine(b.cursorY + b.baseY)?.translateToString(true) ?? '');
    }""")
    page.locator("#terminal").click()
    page.keyboard.type("echo console-$((6 * 7))\n")
    printed(page, "console-42")
    # Reconnect: a new socket (the key in its first message, not its URL), the same shell
    shell = page.locator("#terminal-status").text_content()
    with page.expect_websocket() as opened:
        page.click("#terminal-reconnect")
    assert opened.value.url.endswith(f"/v1/sandboxes/{box.sandbox_id}/pty")
    expect(page.locator("#terminal-status")).to_have_text(shell)
    page.locator("#terminal").click()
    page.keyboard.type("echo again-$((6 * 7))\n")
    printed(page, "again-42")
    # the file browser: an upload lands in the sandbox, a download brings it back
    upload = tmp_path / "from-console.txt"
    upload.write_text("uploaded through the console\n")
    page.set_input_files("#files-upload", str(upload))
    entry = page.locator("#files tr[data-name='from-console.txt']")
    expect(entry).to_be_visible()
    assert box.files.read("/root/from-console.txt") == "uploaded through the console\n"
    with page.expect_download() as download:
        entry.locator("[data-action=download]").click()
    assert Path(download.value.path()).read_text() == "uploaded through the console\n"
    page.screenshot(path=SHOTS / "sandbox.png")
    assert page.console_errors == []  # type: ignore[attr-defined]
    page.close()


def test_a_snapshot_and_a_fork_made_in_the_console_are_in_the_tree_with_their_children(
        browser, server, keys, made) -> None:
    page = open_console(browser, server, keys["a"])
    box = new_sandbox(server, keys["a"], made)
    row = page.locator(f"#sandboxes tr[data-id='{box.sandbox_id}']")
    row.locator("[data-action=snapshot]").click()
    page.fill("#snapshot-name", "console-snap")
    page.click("#dialog-ok")
    expect(page.locator("#notice")).to_contain_text("snapshot: done")
    row.locator("[data-action=fork]").click()
    page.fill("#fork-count", "1")
    page.click("#dialog-ok")
    expect(page.locator("#notice")).to_contain_text("fork: done")

    page.click("nav a[href='#/tree']")
    page.wait_for_function("""(sid) => {
        const cy = window.sandlotTree;
        return cy && cy.nodes('.snapshot.ready').some(n => n.data('label').startsWith(
            'console-snap') && n.incomers('node').some(p => p.id() === 's:' + sid));
    }""", arg=box.sandbox_id)
    snap = page.evaluate("window.sandlotTree.nodes('.snapshot').filter(n => "
                         "n.data('label').startsWith('console-snap'))[0].id()")
    page.wait_for_function("""(sid) => window.sandlotTree.getElementById('s:' + sid)
        .outgoers('edge[label = "fork"]').length === 1""", arg=box.sandbox_id)
    fork = page.evaluate(f"window.sandlotTree.getElementById('s:{box.sandbox_id}')"
                         ".outgoers('edge[label = \"fork\"]')[0].target().id().slice(2)")
    made.append(Sandbox.connect(fork, api_url=server.url, api_key=keys["a"]))
    page.evaluate(f"window.sandlotTree.getElementById({snap!r}).emit('tap')")
    page.click("#tree-panel [data-action=start]")
    page.fill("#start-count", "2")
    page.click("#dialog-ok")
    page.wait_for_function(f"""() => window.sandlotTree.getElementById({snap!r})
        .outgoers('node.sandbox.running').length === 2""")
    children = page.evaluate(f"window.sandlotTree.getElementById({snap!r})"
                             ".outgoers('node').map(n => n.id().slice(2))")
    made.extend(Sandbox.connect(c, api_url=server.url, api_key=keys["a"]) for c in children)
    page.evaluate("window.sandlotTree.fit(undefined, 30)")
    page.screenshot(path=SHOTS / "tree.png")
    assert page.console_errors == []  # type: ignore[attr-defined]
    page.close()


def test_a_key_sees_nothing_it_does_not_own(browser, server, keys, made) -> None:
    a = open_console(browser, server, keys["a"])
    b = open_console(browser, server, keys["b"])
    box = new_sandbox(server, keys["a"], made)
    expect(a.locator(f"#sandboxes tr[data-id='{box.sandbox_id}']")).to_be_visible()
    # b's page got no event of it, and a reload lists none of a's either
    assert b.locator("#sandboxes tbody tr").count() == 0
    b.reload()
    expect(b.locator("#live.on")).to_be_visible()
    expect(b.locator("#count")).to_have_text("0 shown")
    b.click("nav a[href='#/tree']")
    b.wait_for_function("() => window.sandlotTree !== undefined")
    assert b.evaluate("window.sandlotTree.nodes('.sandbox, .snapshot').length") == 0
    b.goto(f"{server.url}/console/#/sandbox/{box.sandbox_id}")
    expect(b.locator("#error")).to_contain_text("not found")
    a.close()
    b.close()


def test_hosts_are_for_admin_keys(browser, server, keys) -> None:
    admin = open_console(browser, server, server.key)
    admin.click("nav a[href='#/hosts']")
    row = admin.locator("#hosts tbody tr").first
    expect(row).to_contain_text("active")
    expect(row.locator("[data-action=drain]")).to_be_visible()
    admin.screenshot(path=SHOTS / "hosts.png")
    admin.close()
    tenant = open_console(browser, server, keys["b"])
    tenant.click("nav a[href='#/hosts']")
    expect(tenant.locator("#error")).to_contain_text("for the deployment's operators")
    tenant.close()
