"""Each sandbox's QEMU is confined (vmm/jail.py), seen from outside as an operator would:
its own unprivileged uid, no capabilities, QEMU's seccomp filter, a cgroup with its limits, a
mount namespace that shows only what it needs, files only it may write; and nothing of it
left once the sandbox is gone."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from sandlot import Sandbox
from sandlot.vmm.jail import QEMU_OVERHEAD_MB, UID_BASE, UID_DIR, VM_GID


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def cgroups(pid: int) -> dict[str, str]:
    """controller -> cgroup path of process `pid` (v1 lines, and '' for v2)."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def limit(pid: int, v1: tuple[str, str], v2: str) -> str:
    groups = cgroups(pid)
    if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
        return (Path("/sys/fs/cgroup") / groups[""].lstrip("/") / v2).read_text().strip()
    controller, name = v1
    return (Path("/sys/fs/cgroup") / controller / groups[controller].lstrip("/")
            / name).read_text().strip()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_qemu_runs_unprivileged_under_seccomp_in_a_cgroup(sandbox_factory, server):
    sbx = sandbox_factory(memory_mb=1024, cpus=2)
    other = sandbox_factory()
    pid, other_pid = sbx.get_info().pid, other.get_info().pid
    st = status(pid)
    uid = int(st["Uid"].split()[0])
    assert all(int(u) == uid for u in st["Uid"].split()) and uid >= UID_BASE
    assert int(st["Gid"].split()[0]) != 0 and st["Groups"].split() == [str(VM_GID)]
    assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000"
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
    assert int(status(other_pid)["Uid"].split()[0]) not in (0, uid)  # a uid each

    # Its limits: guest RAM (twice: its image's pages and its own) plus QEMU's own,
    # processes, and its vCPUs' worth of CPU.
    assert int(limit(pid, ("memory", "memory.limit_in_bytes"), "memory.max")) == \
        (2 * 1024 + QEMU_OVERHEAD_MB) << 20
    assert int(limit(pid, ("pids", "pids.max"), "pids.max")) > 0
    quota = limit(pid, ("cpu", "cpu.cfs_quota_us"), "cpu.max").split()[0]
    assert int(quota) == 200_000

    # Its files: its disk and run dir are its own and closed to others; image files in the
    # hot cache are for VMs only.
    disk = Path(next(p for p in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                     if "file.filename=" in p).split("file.filename=")[1].split(",")[0])
    for path in (disk, disk.parent):
        info = path.stat()
        assert info.st_uid == uid and not info.st_mode & 0o077, path
    ram = Path(next(p for p in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                    if "mem-path=" in p).split("mem-path=")[1].split(",")[0])
    info = ram.stat()
    assert info.st_gid == VM_GID and not info.st_mode & stat.S_IRWXO

    # Its mount namespace shows the system's programs, a few devices and its own paths; not
    # the host's /etc, home directories, the server's data, or another sandbox's files.
    root = Path(f"/proc/{pid}/root")
    assert sorted(p.name for p in (root / "etc").iterdir()) == ["ld.so.cache"]
    assert {p.name for p in (root / "dev").iterdir()} - {"shm"} == \
        {"null", "random", "urandom", "zero"}  # shm: the way to its image
    assert not (root / "root").exists() and not (root / "home").exists()
    assert (root / str(disk).lstrip("/")).exists() and (root / str(ram).lstrip("/")).exists()
    other_disk = Path(next(p for p in Path(f"/proc/{other_pid}/cmdline").read_text()
                           .split("\0") if "file.filename=" in p)
                      .split("file.filename=")[1].split(",")[0])
    assert not (root / str(other_disk).lstrip("/")).exists()
    assert not (root / str(server.data_dir / "sandlot.db").lstrip("/")).exists()
    proc_mount = next(line for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
                      if line.split(" - ")[1].startswith("proc "))
    assert "hidepid=invisible" in proc_mount  # it sees its own processes only

    # A guest busy on every CPU gets no more than its vCPUs' worth of host CPU.
    sbx.commands.run("for i in 1 2 3 4; do timeout 4 sh -c 'while :; do :; done' & done",
                     timeout=30)
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(3)
    used = (cpu_seconds(pid) - before) / (time.monotonic() - t0)
    assert used <= 2.0 * 1.15, f"{used:.2f} cores used by a 2-CPU sandbox"

    sbx.kill()
    assert not Path(f"/proc/{pid}").exists() or status(pid).get("State", "").startswith("Z")
    deadline = time.monotonic() + 60
    while (UID_DIR / str(uid)).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (UID_DIR / str(uid)).exists(), "its uid was not freed"
    assert not disk.parent.exists()
    assert other.commands.run("echo still here").stdout.strip() == "still here"


def test_snapshot_fork_and_restore_of_a_confined_sandbox(sandbox_factory):
    """Capture and restore work with QEMU unprivileged: the device state is written where
    it may write, the next disk overlay is its own, children get uids of their own."""
    sbx = sandbox_factory()
    sbx.files.write("/root/mark", "confined")
    snap = sbx.create_snapshot()
    snap.wait(timeout=120)
    result = sbx.fork(count=2)
    kids = list(result)
    uids = {int(status(s.get_info().pid)["Uid"].split()[0]) for s in [sbx, *kids]}
    assert len(uids) == 3
    restored = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=120)
    try:
        for s in [*kids, restored]:
            assert s.files.read("/root/mark") == "confined"
    finally:
        for s in [*kids, restored]:
            s.kill()


def _default_signals() -> None:
    import signal

    for sig in set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP}:
        signal.signal(sig, signal.SIG_DFL)


def test_jail_helper_confines_as_the_chain_of_shell_tools(tmp_path):
    """sandlot-jail (one exec) puts a process where the chain of shell tools it replaces puts
    it: same uid, groups, capabilities, no_new_privs, cgroups, network namespace, mounts and
    environment; and a failure exits 125 before the command runs."""
    import secrets
    import subprocess
    from dataclasses import replace

    from sandlot.images.guest import build_jail_helper
    from sandlot.testing import IMAGES_DIR
    from sandlot.vmm.jail import Jails, Limits, ensure_traversable

    instance = "jt" + secrets.token_hex(3)
    jails = Jails(instance, helper=build_jail_helper(IMAGES_DIR / "guest"))
    rw = tmp_path / "rw"
    rw.mkdir()
    jail = jails.make("vm-1", Limits.for_vm(256, 1), rw=(rw,))
    jail.own(rw)
    ensure_traversable(rw)
    netns = f"sl-{instance}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    probe = ["/bin/sh", "-c", "id; grep -E '^(Uid|Gid|Groups|Cap|NoNewPrivs|SigBlk|SigIgn)' "
             "/proc/self/status; cat /proc/self/cgroup; cut -d' ' -f4- /proc/self/mountinfo; "
             "readlink /proc/self/ns/net; ls -a /; echo x > $0/f; cat $0/f; env", str(rw)]
    env = {"PATH": os.environ["PATH"], "SANDLOT_PROBE": "1"}
    try:
        helper = replace(jail, netns=netns)
        chain = replace(helper, helper=None)
        assert helper.prefix()[0].endswith("sandlot-jail")
        # Both start from default signal dispositions: what a parent ignores is inherited
        # (a backgrounded `make ci` ignores SIGINT and SIGQUIT), and the helper, a Go
        # program, keeps an inherited SIG_IGN only for SIGHUP and SIGINT.
        ours = subprocess.run(helper.prefix() + probe, env=env, capture_output=True, text=True,
                              preexec_fn=_default_signals)
        theirs = subprocess.run(chain.prefix() + probe, env=env, capture_output=True, text=True,
                                preexec_fn=_default_signals)
        assert ours.returncode == theirs.returncode == 0, (ours.stderr, theirs.stderr)
        # The shell chain's `cd` leaves OLDPWD behind; nothing else may differ.
        assert ours.stdout.splitlines() == [line for line in theirs.stdout.splitlines()
                                            if not line.startswith("OLDPWD=")]
        assert f"uid={jail.uid}" in ours.stdout and "SANDLOT_PROBE=1" in ours.stdout
        assert "x" in ours.stdout.splitlines()  # it wrote its own directory
        assert "CapBnd:\t0000000000000000" in ours.stdout and "NoNewPrivs:\t1" in ours.stdout
        bad = replace(helper, fstab=str(tmp_path / "missing.fstab"))
        failed = subprocess.run(bad.prefix() + ["/bin/sh", "-c", "echo ran"],
                                capture_output=True, text=True)
        assert failed.returncode == 125 and "ran" not in failed.stdout
        assert "missing.fstab" in failed.stderr
    finally:
        subprocess.run(["ip", "netns", "del", netns])
        jails.release(jail)
        jails.recover(keep=set())
