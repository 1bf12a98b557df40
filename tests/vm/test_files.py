"""Files through the SDK: every operation, and a 200 MB streamed round trip."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from sandlot import InvalidArgumentError, NotFoundError, Sandbox


@pytest.fixture(scope="module")
def box(server):
    sbx = Sandbox.create(timeout=900)
    yield sbx
    sbx.kill()


def test_write_read_text_and_bytes(box):
    info = box.files.write("/tmp/deep/er/hello.txt", "hello\n")
    assert info.path == "/tmp/deep/er/hello.txt" and info.size == 6
    assert box.files.read("/tmp/deep/er/hello.txt") == "hello\n"
    payload = bytes(range(256)) * 4
    box.files.write("/tmp/bin.dat", payload)
    assert box.files.read("/tmp/bin.dat", format="bytes") == payload
    assert box.commands.run("cat /tmp/deep/er/hello.txt").stdout == "hello\n"


def test_list_stat_exists_mkdir_rename_remove(box):
    assert box.files.make_dir("/tmp/d1/sub") is True
    assert box.files.make_dir("/tmp/d1/sub") is False
    box.files.write("/tmp/d1/a.txt", "a")
    box.files.write("/tmp/d1/sub/b.txt", "bb")
    names = {e.name: e.type for e in box.files.list("/tmp/d1")}
    assert names == {"a.txt": "file", "sub": "dir"}
    deep = {e.path for e in box.files.list("/tmp/d1", depth=2)}
    assert "/tmp/d1/sub/b.txt" in deep
    st = box.files.stat("/tmp/d1/sub/b.txt")
    assert st.size == 2 and st.type == "file" and st.owner == "root"
    box.files.rename("/tmp/d1/a.txt", "/tmp/d1/c.txt")
    assert not box.files.exists("/tmp/d1/a.txt") and box.files.exists("/tmp/d1/c.txt")
    box.files.remove("/tmp/d1")
    assert not box.files.exists("/tmp/d1")
    with pytest.raises(NotFoundError):
        box.files.list("/tmp/d1")
    with pytest.raises(NotFoundError):
        box.files.remove("/tmp/d1")
    with pytest.raises(InvalidArgumentError):
        box.files.read("/tmp")  # a directory


def test_file_metadata_written_listed_renamed_replaced(box):
    entry = box.files.write("/root/meta/a.txt", "a", metadata={"Job": "42"})
    assert entry.metadata == {"job": "42"}
    assert box.files.stat("/root/meta/a.txt").metadata == {"job": "42"}
    box.files.rename("/root/meta/a.txt", "/root/meta/b.txt")
    assert [e.metadata for e in box.files.list("/root/meta")] == [{"job": "42"}]
    assert box.files.write("/root/meta/b.txt", "b").metadata is None  # an overwrite clears it
    with pytest.raises(InvalidArgumentError):
        box.files.write("/root/meta/c.txt", "c", metadata={"k": "caf\u00e9"})


def test_write_as_user_sets_owner(box):
    box.files.write("/home/user/work/notes.txt", "mine", user="user")
    assert box.files.stat("/home/user/work/notes.txt").owner == "user"
    assert box.commands.run("echo more >> ~/work/notes.txt && cat ~/work/notes.txt",
                            user="user").stdout == "minemore\n"


def test_200mb_round_trip(box, tmp_path):
    size_mb = 200
    block = os.urandom(1 << 20)
    sha = hashlib.sha256()

    def chunks():
        for i in range(size_mb):
            chunk = block[i:] + block[:i]
            sha.update(chunk)
            yield chunk

    info = box.files.write("/home/user/big.bin", chunks())
    assert info.size == size_mb << 20
    guest_sum = box.commands.run("sha256sum /home/user/big.bin", timeout=300).stdout.split()[0]
    assert guest_sum == sha.hexdigest()
    back = hashlib.sha256()
    total = 0
    with box.files.read("/home/user/big.bin", format="stream") as stream:
        for chunk in stream:
            assert len(chunk) <= 4 << 20  # streamed, never whole
            back.update(chunk)
            total += len(chunk)
    assert total == size_mb << 20 and back.hexdigest() == sha.hexdigest()
    box.files.remove("/home/user/big.bin")


def test_a_stalled_file_reader_does_not_stall_the_sandbox(box):
    """A client that opens a big file and stops reading holds back that file only: commands
    and other files in the sandbox still answer, and the read finishes once resumed."""
    size = 96 << 20  # well past the server's stream queue and the socket buffers
    box.commands.run(f"head -c {size} /dev/zero > /root/stalled.bin; echo -n x > /tmp/x",
                     check=True)
    with box.files.read("/root/stalled.bin", format="stream") as stream:
        chunks = iter(stream)
        got = len(next(chunks))
        time.sleep(3)  # let the file fill every buffer on its way that it can
        answers: list[str] = []
        worker = threading.Thread(target=lambda: answers.append(
            box.commands.run("echo alive").stdout + box.files.read("/tmp/x")))
        worker.start()
        worker.join(60)
        assert answers == ["alive\nx"], "the sandbox stalled behind an unread file"
        got += sum(len(c) for c in chunks)
    assert got == size


def test_files_whose_size_is_no_promise_read_whole(box):
    """/proc files report size 0; a file that grows while it is read reports what it was:
    reads go to the end the guest finds, and the connection stays usable."""
    assert "processor" in box.files.read("/proc/cpuinfo")
    box.commands.run("(for i in $(seq 400); do head -c 4096 /dev/zero >> /tmp/grow; "
                     "sleep 0.01; done) >/dev/null 2>&1 &")
    deadline = time.monotonic() + 30
    while not box.files.exists("/tmp/grow"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(5):
        data = box.files.read("/tmp/grow", format="bytes")
        assert len(data) % 4096 == 0 and set(data) <= {0}
    assert box.commands.run("echo still here").stdout == "still here\n"
