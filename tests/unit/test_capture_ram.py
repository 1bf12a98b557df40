"""A capture's RAM before its file is written (vmm/memory.Patched): it reads back exactly as
the file `write_image` makes, and storing it gives the same manifest and chunks as storing
that file (a snapshot is stored from the capture's buffer and its RAM file written after)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from harness import rand, sparse_file
from sandlot.storage.chunks import DigestMemo
from sandlot.storage.objects import LocalObjectStore
from sandlot.storage.store import Source, Store
from sandlot.vmm import memory
from sandlot.vmm.memory import PAGE, Delta, Patched, Region
from sandlot.vmm.snapshot import PendingRam

MiB = 1 << 20
SIZE = 16 * MiB


def delta_over(base, pages: list[int], seed: int, slotted: bool = False) -> Delta:
    """Pages `pages` of a region over `base` (None: anonymous), holding random data, a few
    of them zero (a page the guest zeroed over old data becomes a hole). `slotted`: the pages
    out of order in a bigger buffer, as a precopy leaves pages new in its pause
    (`Delta.slots`): runs in order with every ninth page moved to the end, past free slots."""
    pages_arr = np.array(sorted(set(pages)), dtype=np.int64)
    data = bytearray(rand(len(pages_arr) * PAGE, seed))
    for slot in range(0, len(pages_arr), 7):
        data[slot * PAGE:(slot + 1) * PAGE] = bytes(PAGE)
    region = Region("ram", 0, SIZE, base)
    if not slotted:
        return Delta(region, pages_arr, memoryview(data))
    n = len(pages_arr)
    moved = np.zeros(n, dtype=bool)
    moved[4::9] = True
    slots = np.empty(n, dtype=np.int64)
    slots[~moved] = np.arange(int((~moved).sum()))
    slots[moved] = n + 5 + np.arange(int(moved.sum()))
    buffer = bytearray(int(slots.max() + 1) * PAGE)
    for i, slot in enumerate(slots.tolist()):
        buffer[slot * PAGE:(slot + 1) * PAGE] = data[i * PAGE:(i + 1) * PAGE]
    return Delta(region, pages_arr, memoryview(buffer), slots)


def changed_pages() -> list[int]:
    pages = list(range(0, 40))  # whole chunks, and a partial one
    pages += [100, 101, 102, 300, 301]  # in a chunk of the base's data, partly
    pages += list(range(1700, 1700 + 512))  # 2 MiB over the base's data and past it
    pages += [3007, 3008, 3009]  # across a chunk boundary in a hole
    pages += [SIZE // PAGE - 1]  # the last page
    return pages


@pytest.fixture(params=["file", "anonymous"])
def base(request, tmp_path):
    if request.param == "anonymous":
        return None
    return sparse_file(tmp_path / "base", SIZE, {0: rand(MiB, 1), 4 * MiB: rand(3 * MiB, 2),
                                                 12 * MiB + 5: rand(5000, 3)})


@pytest.fixture(params=["in order", "slotted"])
def slotted(request) -> bool:
    return request.param == "slotted"


def test_reads_are_the_written_file(base, slotted, tmp_path) -> None:
    delta = delta_over(base, changed_pages(), 9, slotted)
    if slotted:  # the same file as with the pages in order
        plain = tmp_path / "plain"
        memory.write_image(delta_over(base, changed_pages(), 9), plain)
    written = tmp_path / "written"
    memory.write_image(delta, written)
    expect = written.read_bytes()
    if slotted:
        assert expect == plain.read_bytes()
    patched = Patched(delta)
    try:
        for offset in range(0, SIZE, 64 << 10):
            assert patched.read(offset, 64 << 10) == expect[offset:offset + (64 << 10)]
        for offset, length in ((0, SIZE), (PAGE * 100, 3 * PAGE), (SIZE - PAGE, 64 << 10)):
            assert patched.read(offset, length) == expect[offset:offset + length]
        data = {int(i) for i in patched.data_chunks(64 << 10)}
        for i in range(SIZE // (64 << 10)):
            if expect[i << 16:(i + 1) << 16].strip(b"\0"):
                assert i in data, f"chunk {i} holds data"
        again = tmp_path / "again"
        patched.write(again)
        assert again.read_bytes() == expect
    finally:
        patched.close()


async def test_storing_it_is_storing_the_file(base, slotted, tmp_path) -> None:
    delta = delta_over(base, changed_pages(), 10, slotted)
    written = tmp_path / "written"
    memory.write_image(delta, written)
    expect = written.read_bytes()
    ranges = [(int(first) * PAGE, int(count) * PAGE) for first, count in memory.runs(delta.pages)]
    stores, manifests = [], []
    patched = Patched(delta)
    try:
        for name, data in (("file", written), ("buffer", patched)):
            store = Store(LocalObjectStore(tmp_path / f"store-{name}"))
            base_manifest = None
            if base is not None:
                base_manifest, _ = await store.put("base", "template", {"ram": Source(base)},
                                                   {}, {})
            manifest, _ = await store.put("snap", "snapshot", {"ram": Source(data, ranges)}, {},
                                          {}, base=base_manifest)
            stores.append(store)
            manifests.append(manifest)
        whole, _ = await stores[1].put("whole", "snapshot", {"ram": Source(patched)}, {}, {})
    finally:
        patched.close()
    assert manifests[1].files == manifests[0].files
    assert whole.files["ram"].chunks == manifests[0].files["ram"].chunks
    os.unlink(written)  # the chunks uploaded from the buffer, fetched back: the same file
    out = tmp_path / "out"
    await stores[1].fetch("snap", {"ram": out})
    assert out.read_bytes() == expect


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_copy_is_cut_into_equal_shares_covering_each_page_once(threads) -> None:
    """The pause's copy (read_pages) runs in `threads` shares of equal bytes: one run of
    pages often holds most of what changed, so runs are cut where a share ends."""
    pages = np.concatenate([np.arange(3, 40, 3), np.arange(100, 100 + 28000),
                            np.arange(40000, 40007)]).astype(np.int64)
    r = memory.runs(pages)
    lengths = r[:, 1] * PAGE
    local = (1 << 30) + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    remote = (1 << 40) + r[:, 0] * PAGE
    shares = memory._shares(local, remote, lengths, threads)
    assert len(shares) == threads
    copied: dict[int, int] = {}  # guest page -> buffer slot
    for loc, rem in shares:
        assert (loc[:, 1] == rem[:, 1]).all() and (loc[:, 1] > 0).all()
        for (la, n), ra in zip(loc.tolist(), rem[:, 0].tolist(), strict=True):
            for k in range(n // PAGE):
                page = (ra - (1 << 40)) // PAGE + k
                assert page not in copied
                copied[page] = (la - (1 << 30)) // PAGE + k
    assert copied == {int(p): slot for slot, p in enumerate(pages)}
    sizes = [int(loc[:, 1].sum()) for loc, _ in shares]
    assert max(sizes) - min(sizes) <= PAGE


def test_a_failed_write_frees_the_capture(tmp_path) -> None:
    """Closing a capture's pending RAM after its write failed, with the failure's traceback
    still holding a view of the buffer (write_image's array of words), raises nothing: the
    writer's cleanup (runtime/qemu.py) must run to its end, or restores would wait for the
    entry forever."""
    buffer = memory.PageBuffer(64)
    pages = np.arange(10, 20, dtype=np.int64)
    data = buffer.view(len(pages))
    data[:] = rand(len(pages) * PAGE, 4)
    pending = PendingRam([Delta(Region("ram", 0, SIZE, None), pages, data)], buffer,
                         {"ram": tmp_path / "gone" / "ram"})
    with pytest.raises(OSError):
        pending.write()
    words = np.frombuffer(pending.files["ram"].delta.data, dtype=np.uint64)  # as a traceback
    pending.close()
    assert words.sum() >= 0  # still readable: unmapped only when the last view goes


async def test_a_digest_memo_gives_the_digests_sha256_would(tmp_path) -> None:
    """Chunks a sandbox's last snapshot hashed are found by their BLAKE3 digest and not
    hashed with SHA-256 again: the manifest is the same as without the memo."""
    if not DigestMemo.available():
        pytest.skip("blake3 is not installed")
    store = Store(LocalObjectStore(tmp_path / "store"))
    path = sparse_file(tmp_path / "ram", SIZE, {0: rand(4 * MiB, 1), 8 * MiB: rand(MiB, 2)})
    first = DigestMemo()
    plain = await store.chunks.hash_file(path)
    assert await store.chunks.hash_file(path, memo=first) == plain
    assert first.reused == 0 and len(first.seen) == len(plain.chunks)
    with open(path, "r+b") as f:  # one chunk changes
        f.seek(MiB)
        f.write(rand(64 << 10, 3))
    again = DigestMemo(first.seen)
    assert await store.chunks.hash_file(path, memo=again) == await store.chunks.hash_file(path)
    assert again.reused == len(plain.chunks) - 1


_MAPPER = """
import mmap, sys
path, out = sys.argv[1], sys.argv[2]
with open(path, "r+b") as f:  # as QEMU maps a RAM file with share=off: private, writable
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
print("mapped", flush=True)
sys.stdin.readline()
with open(out, "wb") as f:
    f.write(m[:])
"""


def test_a_delta_written_into_a_process_mapping_its_base_is_its_image(slotted, tmp_path
                                                                        ) -> None:
    """A restore from a snapshot whose RAM file is still being written (runtime/unwritten.py):
    the captured pages written into another process's private mapping of the base file make
    that mapping the written file, and leave the base file as it was."""
    import subprocess
    import sys

    base = sparse_file(tmp_path / "base", SIZE, {0: rand(MiB, 1), 4 * MiB: rand(3 * MiB, 2)})
    before = base.read_bytes()
    delta = delta_over(base, changed_pages(), 11, slotted)
    memory.write_image(delta, tmp_path / "written")
    proc = subprocess.Popen([sys.executable, "-c", _MAPPER, str(base), str(tmp_path / "seen")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        region = memory.regions(proc.pid, (base, SIZE), None)[0]
        memory.write_delta(proc.pid, region, delta)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert (tmp_path / "seen").read_bytes() == (tmp_path / "written").read_bytes()
    assert base.read_bytes() == before
