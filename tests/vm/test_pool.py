"""The warm pool: a create with the template's own memory is served by a sandbox restored ahead
of time, and gets an identity of its own (env, generation, RNG, clock, CPUs; egress rules:
tests/vm/test_sandbox_network.py); other memory sizes are ordinary restores; pooled VMs never
outlive their server."""

from __future__ import annotations

import signal
import time

from snapkit import clock_error, generation, urandom, wait_for

from harness import qemu_pids
from sandlot import Sandbox, Sandlot


def pool_of(client: Sandlot, name: str = "base") -> dict:
    return client.health()["pool"][name]


def full_pool(client: Sandlot) -> dict:
    return wait_for(lambda: (p := pool_of(client))["ready"] == p["size"] and p, timeout=90,
                    what="a full warm pool")


def test_pooled_creates_get_identities_of_their_own(server, sandbox_factory):
    with Sandlot() as client:
        before = full_pool(client)
        assert before["size"] >= 2
        a = sandbox_factory(env={"WHO": "a"}, metadata={"k": "a"})
        b = sandbox_factory(env={"WHO": "b"})
        after = pool_of(client)
    assert after["claimed"] == before["claimed"] + 2
    assert a.commands.run("echo $WHO").stdout == "a\n"
    assert b.commands.run("echo $WHO").stdout == "b\n"
    gen_a, gen_b = generation(a), generation(b)
    assert gen_a[0] == gen_a[1] and gen_b[0] == gen_b[1]
    assert gen_a[0] != gen_b[0]
    assert urandom(a) != urandom(b)
    error, allowed = clock_error(a)
    assert abs(error) <= allowed
    assert a.get_info().metadata == {"k": "a"}
    # The pool's warm-up command is not one of the sandbox's processes.
    assert a.commands.list() == []
    assert [s.sandbox_id for s in Sandbox.list(metadata={"k": "a"})] == [a.sandbox_id]


def test_cpus_are_set_at_claim_and_other_memory_is_a_restore(server, sandbox_factory):
    with Sandlot() as client:
        before = full_pool(client)
        two = sandbox_factory(cpus=2)
        assert pool_of(client)["claimed"] == before["claimed"] + 1
        full_pool(client)
        bigger = sandbox_factory(memory_mb=640)
        assert pool_of(client)["claimed"] == before["claimed"] + 1
    assert two.commands.run("nproc").stdout == "2\n"
    assert two.get_info().cpus == 2
    assert mem_total_kb(bigger) - mem_total_kb(two) >= 120 * 1024  # a 128 MiB DIMM more


def mem_total_kb(sbx: Sandbox) -> int:
    return int(sbx.commands.run("grep MemTotal /proc/meminfo").stdout.split()[1])


def test_pooled_vms_do_not_outlive_their_server(server_factory):
    srv = server_factory(SANDLOT_POOL_SIZE="2")
    with Sandlot(**srv.client_kwargs()) as client:
        full_pool(client)
    assert len(qemu_pids(srv.run_root)) == 2
    srv.stop(signal.SIGKILL)  # pooled VMs are orphans now: in no record
    srv.extra_env["SANDLOT_POOL_SIZE"] = "0"
    srv.start()
    deadline = time.monotonic() + 10
    while qemu_pids(srv.run_root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert qemu_pids(srv.run_root) == []
