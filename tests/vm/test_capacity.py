"""A host keeps a reserve of memory and disk: a sandbox that would eat into it is refused
with a CapacityError (503) that says what is missing, before any QEMU starts."""

from __future__ import annotations

import pytest

from harness import qemu_pids
from sandlot import CapacityError, Sandbox


@pytest.mark.parametrize("setting, what", [("SANDLOT_RESERVE_MEM_MB", "memory"),
                                           ("SANDLOT_RESERVE_DISK_MB", "free")])
def test_a_create_past_the_hosts_reserve_is_refused(server_factory, setting, what):
    srv = server_factory(**{setting: str(1 << 30), "SANDLOT_POOL_SIZE": "0"})
    with pytest.raises(CapacityError) as exc:
        Sandbox.create(timeout=60, **srv.client_kwargs())
    assert what in str(exc.value) and setting in str(exc.value), str(exc.value)
    assert qemu_pids(srv.run_root) == []
