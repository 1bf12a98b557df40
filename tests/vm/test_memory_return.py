"""Memory a guest frees, and the host (issue #16). A restored sandbox maps its image's RAM
copy-on-write, so the pages it writes become its QEMU's own and stay so after the guest frees
them (QEMU's balloon and free page reporting would punch holes in the image every sibling maps:
docs/security.md). What gives them back is a pause and resume: the guest zeroes what it frees
(`init_on_free`), zero pages are holes in the pause's image, and the resumed VM shares them."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vm


def _own_mib(pid: int) -> float:
    """The QEMU's anonymous memory: the guest pages it changed, and its own heap."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no Anonymous line")


def test_memory_the_guest_freed_goes_back_to_the_host_through_a_pause(sandbox_factory):
    sbx = sandbox_factory(memory_mb=512)
    before = _own_mib(sbx.get_info().pid)
    # 256 MiB allocated, touched and freed again (dd's buffer; the process exits).
    sbx.commands.run("dd if=/dev/zero of=/dev/null bs=256M count=1", check=True, timeout=120)
    touched = _own_mib(sbx.get_info().pid)
    assert touched - before > 200, (before, touched)

    sbx.pause()
    sbx.resume()
    after = _own_mib(sbx.get_info().pid)
    print(f"own memory: {before:.0f} MiB, {touched:.0f} after 256 MiB touched and freed, "
          f"{after:.0f} after a pause and resume")
    assert after < before + 48, (before, touched, after)
    assert sbx.commands.run("echo alive").stdout == "alive\n"
