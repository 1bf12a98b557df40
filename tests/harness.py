"""Helpers the VM tests share: a real sandlot server process per test or session, the
QEMU processes under a data dir. Imported by name (`from harness import ...`); pytest's
conftest modules are not importable by name once there is more than one."""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import os
import random
import re
import secrets
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from sandlot import testing
from sandlot.vmm.processes import cmdline as qemu_cmdline
from sandlot.vmm.processes import qemus_under

IMAGES_DIR = testing.IMAGES_DIR
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
Server = testing.ServerProcess
qemu_pids = qemus_under
# This run's tag: every server's instance starts with it, so what a server names host-wide
# (run dir, tmpfs files, network namespaces and veth aliases, VM uids, cgroups) is this run's
# alone, even with another run on the host (a pid may repeat across pid namespaces); and its
# servers' nft table and veths are named after it.
RUN = "t" + secrets.token_hex(3)
NET_TABLE = f"sandlot_{RUN[1:]}"  # its servers' nft table (conftest removes it at the end)


# The test running now when it is not marked `vm` (conftest sets it): it may start no server.
unmarked: list[str] = []


def own_qemus() -> list[int]:
    """The QEMUs of this run: under a run dir of one of its servers, or below this process."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not os.readlink(entry / "exe").rsplit("/", 1)[-1].startswith("qemu-system"):
                continue
        except OSError:
            continue
        pid = int(entry.name)
        if f"/run/sandlot-{RUN}" in qemu_cmdline(pid) or me in _ancestors(pid):
            found.append(pid)
    return found


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def make_server(tmp_root: Path, name: str) -> Server:
    """A server with its own data dir and instance (`RUN` + `name`: at most 16 characters of
    [a-z0-9] in all, its network owner tag); the test session's servers share one store (the
    templates are given to it once). Only for a test marked `vm` (conftest marks those)."""
    if unmarked:
        raise RuntimeError(f"{unmarked[0]} starts a sandlot server (VMs) but is not marked "
                           "`vm`: give it the marker (or a fixture in conftest's VM_FIXTURES)")
    store = tmp_root.parent / "store"
    instance = RUN + name
    if not re.fullmatch(r"[a-z0-9]{1,16}", instance):
        raise ValueError(f"instance {instance!r}: the name must be 1-9 of [a-z0-9]")
    return Server(data_dir=tmp_root / f"data-{name}", instance=instance,
                  log_path=tmp_root / f"server-{name}.log",
                  extra_env={"SANDLOT_STORE": str(store), "SANDLOT_METRICS_INTERVAL": "1",
                             "SANDLOT_NET_TABLE": NET_TABLE})


def cleanup(server: Server) -> None:
    server.close()


def start_cluster(s3, postgres, tmp_path_factory, slots: dict[str, int], label: str,
                  host_env: dict[str, dict[str, str]] | None = None,
                  **env: str) -> dict[str, Server]:
    """The started hosts of one deployment, `slots`: host name -> its SANDLOT_MAX_SANDBOXES
    (host ids `host-<name>`): each with its own data dir and instance, all sharing a new
    PostgreSQL database and S3 prefix (`label` names both), with no warm pool; `host_env`:
    a host's own variables. Each host has a template index of its own, of the base template
    alone (`base_only_images`), as a host of a real deployment has its own images dir."""
    database = postgres.new_database(label + secrets.token_hex(3))
    prefix = f"{label}-{secrets.token_hex(3)}"
    hosts = {}
    for name, count in slots.items():
        root = tmp_path_factory.mktemp(f"host-{name}")
        srv = make_server(root, label[:2] + name)
        srv.extra_env.update({
            "SANDLOT_IMAGES_DIR": str(testing.base_only_images(root / "images")),
            "SANDLOT_DATABASE_URL": database, "SANDLOT_STORE": s3.url(prefix), **s3.env,
            "SANDLOT_HOST_ID": f"host-{name}", "SANDLOT_POOL_SIZE": "0",
            "SANDLOT_MAX_SANDBOXES": str(count), **env, **(host_env or {}).get(name, {})})
        hosts[name] = srv
    try:
        for srv in hosts.values():
            srv.start(timeout=180)
    except BaseException:
        for srv in hosts.values():
            cleanup(srv)
        raise
    return hosts


def sparse_file(path: Path, size: int, data: dict[int, bytes]) -> Path:
    """A sparse file of `size` bytes holding `data` (offset -> bytes)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, chunk in data.items():
            f.seek(offset)
            f.write(chunk)
    return path


def tar_gz(files: dict[str, bytes]) -> bytes:
    """A gzipped tar of `files` (name: contents), names as given (even ones that escape)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def gc_under_concurrent_uploads(store, tmp: Path, count: int, mib: int, gcs: int) -> None:
    """Upload `count` images sharing half their chunks while GC runs `gcs` times with no
    grace, after an image was deleted; every image must then read back whole."""
    from sandlot.storage.gc import collect_garbage
    from sandlot.storage.store import Source

    half = mib * MiB // 2
    common = rand(half, 9)
    files = [sparse_file(tmp / f"f{i}", 2 * half, {0: common, half: rand(half // 2, 10 + i)})
             for i in range(count)]
    await store.put("doomed", "snapshot", {"f": Source(files[0])}, {}, {})
    await store.delete("doomed")

    async def uploads() -> None:
        for i, f in enumerate(files):
            await store.put(f"k{i}", "snapshot", {"f": Source(f)}, {}, {})

    async def collect() -> None:
        for _ in range(gcs):
            await collect_garbage(store, grace=0)
            await asyncio.sleep(0)

    await asyncio.gather(uploads(), collect())
    for _ in range(2):
        await collect_garbage(store, grace=0)
    for i, f in enumerate(files):
        out = tmp / f"out{i}"
        await store.fetch(f"k{i}", {"f": out})
        assert out.read_bytes() == f.read_bytes()


def eventually(check, timeout: float = 10.0) -> None:
    """Poll `check` until it is true; fail after `timeout` seconds (a bound on a wait, not a
    speed)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and proc.returncode:
        raise RuntimeError(f"{argv}: {proc.stderr}")
    return proc.stdout


@contextlib.contextmanager
def own_internet(root: Path, ns: str, veth: str, net: ipaddress.IPv4Network,
                  dns_name: str | None = None):
    """A test's own "internet" (nothing leaves the machine): namespace `ns` behind veth
    `veth` (the host side .1 of `net`), web servers "A" on .2 and "B" on .3 serving
    `site-A`/`site-B`, and with `dns_name` a DNS server on .2 answering it with .3."""
    host_ip, web_a, web_b = (str(net[i]) for i in (1, 2, 3))
    procs: list[subprocess.Popen] = []
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for args in (["addr", "add", f"{web_a}/24", "dev", "eth0"],
                     ["addr", "add", f"{web_b}/24", "dev", "eth0"],
                     ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            sh("ip", "-n", ns, *args)
        for name, addr in (("A", web_a), ("B", web_b)):
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "index.html").write_text(f"site-{name}\n")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "python3", "-m", "http.server", "80", "--bind",
                 addr, "--directory", str(root / name)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wanted = [f"{web_a}:80 ", f"{web_b}:80 "]
        if dns_name:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "dnsmasq", "--no-daemon", "--conf-file=/dev/null",
                 "--no-resolv", "--no-hosts", "--bind-interfaces", f"--listen-address={web_a}",
                 f"--address=/{dns_name}/{web_b}", "--pid-file=", "--user=root"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wanted.append(f"{web_a}:53 ")
        eventually(lambda: all(w in sh("ip", "netns", "exec", ns, "ss", "-lntu", "-H")
                               for w in wanted))
        yield
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
        sh("ip", "link", "del", veth, check=False)
        sh("ip", "netns", "del", ns, check=False)


def delete_tenant_templates(srv: Server, key: str, names: Iterable[str],
                            registry: str) -> None:
    """Remove through the API what a tenant's (`key`) E2B builds left in the images index the
    test servers share: its templates `names`, and the templates of the images it pulled from
    `registry` (host:port) with its own login (`image-t...`). Whatever is not there is
    skipped: for a fixture's teardown, after tests that may have failed anywhere."""
    import httpx

    headers = {"X-API-KEY": key}
    listing = httpx.get(f"{srv.url}/v1/templates", headers=headers, timeout=60)
    listing.raise_for_status()
    pulled = [t["name"] for t in listing.json()["templates"]
              if t["name"].startswith("image-t") and (t.get("image") or "").startswith(
                  registry + "/")]
    for name in (*names, *pulled):
        r = httpx.delete(f"{srv.url}/e2b/templates/{name}", headers=headers, timeout=60)
        assert r.status_code in (204, 404), (name, r.status_code, r.text)


def tenant_key(srv: Server, tenant: str) -> str:
    """A new key of `tenant` (`sandlot keys create`), in the deployment's database if `srv`
    is a host of one."""
    db = {k: v for k, v in srv.extra_env.items() if k == "SANDLOT_DATABASE_URL"}
    out = subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "create", "--tenant",
                          tenant, "--data-dir", str(srv.data_dir)], env={**os.environ, **db},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@contextlib.contextmanager
def e2b_tenant(srv: Server, tenant: str, built: Iterable[str], registry: str
               ) -> Iterator[dict[str, str]]:
    """The E2B SDK's options (`api_url`, `sandbox_url`, `api_key`) for a new key of `tenant`
    on the started `srv`; after: what it built goes from the images index the test servers
    share (`delete_tenant_templates`: `built`, and the images it pulled from `registry`)."""
    key = tenant_key(srv, tenant)
    try:
        yield {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
               "api_key": key}
    finally:
        delete_tenant_templates(srv, key, built, registry)


def secret_nowhere(srv: Server, secret: str) -> bool:
    """`secret` (a login, a key) is in neither the server's log, nor its database, nor its
    data dir."""
    assert secret not in srv.log_path.read_text(errors="replace")
    for path in srv.data_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 64 << 20:
            assert secret.encode() not in path.read_bytes(), path
    return True
