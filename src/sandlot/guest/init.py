#!/usr/bin/python3
"""sandlot guest init (PID 1): mount the basics, configure the network, run the agent, reap.

Installed in the guest as /sbin/sandlot-init; the initramfs switch_roots into it.
"""

import os
import subprocess
import time

AGENT = ["/usr/bin/python3", "-u", "/opt/sandlot/agent.py"]
GUEST_IP = "10.0.2.15/24"
GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"


def sh(*args: str) -> None:
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def mount(fstype: str, target: str, opts: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    cmd = ["mount", "-t", fstype, fstype, target]
    if opts:
        cmd[1:1] = ["-o", opts]
    sh(*cmd)


def setup() -> None:
    mount("proc", "/proc")
    mount("sysfs", "/sys")
    mount("devtmpfs", "/dev")
    mount("devpts", "/dev/pts", "gid=5,mode=620,ptmxmode=666")
    mount("tmpfs", "/dev/shm", "mode=1777")
    mount("tmpfs", "/run", "mode=755")
    mount("tmpfs", "/tmp", "mode=1777")
    mount("cgroup2", "/sys/fs/cgroup")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        if not os.path.lexists(f"/dev/{name}"):
            os.symlink(target, f"/dev/{name}")
    os.makedirs("/run/sandlot", exist_ok=True)
    sh("hostname", "sandlot")
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "set", "eth0", "up")
    sh("ip", "addr", "add", GUEST_IP, "dev", "eth0")
    sh("ip", "route", "add", "default", "via", GATEWAY)
    with open("/etc/resolv.conf", "w") as f:
        f.write(f"nameserver {DNS}\n")


def main() -> None:
    setup()
    agent = subprocess.Popen(AGENT)
    while True:
        try:
            pid, _status = os.wait()
        except ChildProcessError:
            pid = None
            time.sleep(0.1)
        except InterruptedError:
            continue
        if pid == agent.pid or agent.poll() is not None:
            time.sleep(0.2)
            agent = subprocess.Popen(AGENT)


if __name__ == "__main__":
    main()
