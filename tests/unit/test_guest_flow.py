"""One stream never holds up the link: the real agent (the Go binary, its commands run on this
host) and the real host client over a socket pair. A command whose output nobody reads waits
for the host's credits (agent cap `output_credit`) while other requests on the same link are
answered at once; with an agent that pushes output (no credits), the unread stream fails
alone once its bounded inbox is full. Listings are bounded by the agent (`list_limit`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from guestkit import agent_link

from sandlot.errors import GuestError, InvalidArgumentError
from sandlot.guest import client as client_mod
from sandlot.guest.client import AgentClient, Output, Started

BIG = 40_000_000  # bytes of output: far more than the host keeps for one stream


@pytest.fixture
async def linked() -> AsyncIterator:
    """`await linked(*agent_args)`: a ready client of a new agent process."""
    async with contextlib.AsyncExitStack() as made:
        async def link(*args: str) -> AgentClient:
            return await made.enter_async_context(agent_link(*args))

        yield link


async def others_answer_promptly(client: AgentClient) -> None:
    for _ in range(3):  # held up behind the unread output, these would not answer at all
        await asyncio.wait_for(client.ping(), 30)
        done = await asyncio.wait_for(client.run("echo other"), 60)
        assert done.exit_code == 0


async def test_unread_output_waits_for_credit_and_holds_up_nothing_else(linked) -> None:
    client = await linked()
    assert client.has_cap("output_credit")
    try:
        events = client.exec(f"head -c {BIG} /dev/zero")
        assert isinstance(await anext(events), Started)
        await asyncio.sleep(1.0)  # the command writes; nobody reads its output
        await others_answer_promptly(client)
        held = sum(inbox.bytes for inbox in client._streams.values())
        assert held <= 4 << 20, f"the host holds {held} bytes of unread output"
        total = 0
        async for event in events:
            if isinstance(event, Output):
                total += len(event.data)
        assert total == BIG  # nothing lost: the command waited for its reader
    finally:
        await client.close()


async def test_an_agent_without_credits_fails_only_the_unread_stream(
        linked, monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "INBOX_BYTES", 4 << 20)
    client = await linked("-without-cap", "output_credit")
    assert not client.has_cap("output_credit")
    try:
        events = client.exec(f"head -c {BIG} /dev/zero")
        assert isinstance(await anext(events), Started)
        await asyncio.sleep(1.0)
        await others_answer_promptly(client)
        with pytest.raises(GuestError, match="went unread"):
            async for _ in events:
                pass
        await others_answer_promptly(client)
    finally:
        await client.close()


async def test_listing_is_bounded_by_the_agent(linked, tmp_path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02}").write_text("x")
    client = await linked()
    try:
        assert len(await client.list_dir(str(tmp_path), 1, max_entries=30)) == 30
        with pytest.raises(InvalidArgumentError, match="listing too large"):
            await client.list_dir(str(tmp_path), 1, max_entries=29)
    finally:
        await client.close()


async def test_writes_held_for_a_capture_wait_and_then_go(linked) -> None:
    """While a capture's pause holds the link's writes (QEMU would put them in guest RAM with
    the VM stopped), a request waits; it goes, and is answered, once they are released."""
    client = await linked()
    async with client.writes_held():
        ping = asyncio.create_task(client.ping())
        await asyncio.sleep(0.3)
        assert not ping.done()  # not even sent
    await asyncio.wait_for(ping, 5)
    async with client.writes_held():  # a held link with nothing to write
        pass
    assert (await asyncio.wait_for(client.run("echo after"), 10)).exit_code == 0
