"""A snapshot's RAM files while they are being written, as a restore source
(runtime/unwritten.py): the files the capture was taken over are linked into its entry, its
pages stay until the last restore that took them leaves, and the links stay only if a VM maps
them."""

from __future__ import annotations

import numpy as np

from harness import rand, sparse_file
from sandlot.runtime.unwritten import UnwrittenRam
from sandlot.vmm.memory import PAGE, Delta, Region

SIZE = 1 << 20


def _deltas(tmp_path, base: bool = True) -> dict[str, Delta]:
    path = sparse_file(tmp_path / "source-ram", SIZE, {0: rand(PAGE * 4, 1)}) if base else None
    return {"ram": Delta(Region("ram", 0, SIZE, path), np.array([1, 2]),
                         memoryview(bytearray(rand(2 * PAGE, 2))))}


def test_links_stay_with_a_vm_and_the_pages_until_its_restore_leaves(tmp_path) -> None:
    entry = tmp_path / "entry"
    entry.mkdir()
    unwritten = UnwrittenRam.link(entry, _deltas(tmp_path))
    assert unwritten is not None
    link = unwritten.files["ram"]
    assert link.parent == entry and link.samefile(tmp_path / "source-ram")
    closed = []
    unwritten.take()
    unwritten.retire(lambda: closed.append(1))  # the RAM file is written meanwhile
    assert not closed  # the restore still writes from its pages
    unwritten.leave()
    assert closed == [1]
    (tmp_path / "source-ram").unlink()  # the source's entry may go: the VM's file stays
    assert link.exists()


def test_unused_links_go_and_what_cannot_be_linked_is_no_source(tmp_path) -> None:
    entry = tmp_path / "entry"
    entry.mkdir()
    unwritten = UnwrittenRam.link(entry, _deltas(tmp_path))
    closed = []
    unwritten.retire(lambda: closed.append(1))
    assert closed == [1] and not list(entry.iterdir())
    assert UnwrittenRam.link(entry, _deltas(tmp_path, base=False)) is None  # a booted VM's
    gone = _deltas(tmp_path)
    (tmp_path / "source-ram").unlink()  # the source's entry went before the link
    assert UnwrittenRam.link(entry, gone) is None and not list(entry.iterdir())


def test_restores_past_the_budget_wait_for_the_file(tmp_path, monkeypatch) -> None:
    from sandlot.runtime import unwritten as module

    entry = tmp_path / "entry"
    entry.mkdir()
    unwritten = UnwrittenRam.link(entry, _deltas(tmp_path))
    monkeypatch.setattr(module, "PRIVATE_BUDGET", 5 * PAGE)  # room for two copies of 2 pages
    assert unwritten.take() and unwritten.take() and not unwritten.take()
