"""Where sandlot keeps things, and the knobs the server runs with.

Environment: SANDLOT_DATA_DIR (metadata, disks; default /var/lib/sandlot), SANDLOT_IMAGES_DIR
(template builds; default <data>/images), SANDLOT_STORE (where snapshots and templates are
stored: ``s3://BUCKET/PREFIX``, with the standard AWS_* variables, or a directory; default
<data>/store), SANDLOT_CACHE_MB (the local tmpfs cache of image files; default a quarter of
RAM), SANDLOT_INSTANCE (suffix for /run/sandlot and /dev/shm/sandlot, so several servers can
share a host), SANDLOT_ACCEL (kvm|tcg), SANDLOT_POOL_SIZE and SANDLOT_POOL_TEMPLATES (the warm
pool, runtime/pool.py), SANDLOT_GC_GRACE (seconds an unreferenced chunk waits before store GC
takes it; default 3600), SANDLOT_GC_INTERVAL (seconds between GC runs; default 600),
SANDLOT_CONFINE (on: each QEMU under its own uid, seccomp and a cgroup; off: as the server),
SANDLOT_RESERVE_MEM_MB and SANDLOT_RESERVE_DISK_MB (what the host keeps: new sandboxes and
captures are refused with a CapacityError below them; default 5% of RAM, 1024 MiB of disk).
SANDLOT_DISK_QUOTA_MB: the disk a sandbox's guest sees unless its create asks (`disk_mb`, at
most SANDLOT_MAX_DISK_MB), never less than its image's (default 2048): its guest gets ENOSPC
there, and the host admits a sandbox only if every sandbox's disk fits in its free space.
The limits on what a request may carry (`Limits`) are set by SANDLOT_MAX_<FIELD> (e.g.
SANDLOT_MAX_ENV_BYTES, SANDLOT_MAX_PORTS); docs/api.md lists them. SANDLOT_COMMAND_GRACE:
seconds past a command's timeout before the server ends it if the guest has not (default 5).
SANDLOT_REGISTRIES: the registries image pulls may reach (images/egress.py; default: public
addresses only); SANDLOT_INSECURE_REGISTRIES (host[:port],...: reached over plain HTTP) and
SANDLOT_REGISTRY_AUTH_FILE (registry credentials) (images/oci.py); SANDLOT_BUILDAH_DRIVER
(overlay|vfs: Dockerfile builds, images/dockerfile.py). SANDLOT_WRITE_TRACKING=off: captures
copy every changed page in the pause (vmm/write_tracking.py). SANDLOT_ECR_ENDPOINT: the URL of
ECR's API that E2B builds from an AWS registry get their login from (images/ecr.py; default
AWS's endpoint of the build's region; e.g. a VPC endpoint).

Several hosts (docs/cluster.md): SANDLOT_DATABASE_URL (a ``postgresql://`` URL shared by every
host; default SQLite under the data dir), SANDLOT_HOST_ID (this host's stable id; default made
once and kept in <data>/host-id), SANDLOT_ADVERTISE_URL (the URL other hosts reach this one at;
default http://<bind address>:<port>), SANDLOT_MAX_SANDBOXES (sandbox slots of this host;
default one per 256 MiB of RAM), SANDLOT_HEARTBEAT (seconds between heartbeats; default 2) and
SANDLOT_HOST_TIMEOUT (seconds of silence after which a host and its sandboxes are `lost`;
default 6). SANDLOT_METRICS_INTERVAL: seconds between samples of each sandbox's CPU, memory
and disk use (default 5; an hour of them is kept).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import InvalidArgumentError
from sandlot.vmm.accel import detect_accel

DEFAULT_DATA_DIR = Path("/var/lib/sandlot")


def default_data_dir() -> Path:
    return Path(os.environ.get("SANDLOT_DATA_DIR") or DEFAULT_DATA_DIR)


def _mem_total_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return 4096


def _int_env(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, default)))
    except ValueError:
        return default


def _accel_env() -> str | None:
    """SANDLOT_ACCEL (kvm|tcg), or None: this host's best."""
    forced = os.environ.get("SANDLOT_ACCEL", "").strip().lower()
    if forced and forced not in ("kvm", "tcg"):
        raise InvalidArgumentError(f"SANDLOT_ACCEL must be kvm or tcg, not {forced!r}")
    return forced or None


def _url_env(name: str) -> str | None:
    """An http(s) URL from `name`, or None when unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    scheme, _, rest = value.partition("://")
    if scheme not in ("http", "https") or not rest.split("/")[0]:
        raise InvalidArgumentError(f"{name} must be an http(s) URL, not {value[:80]!r}")
    return value


def _off(name: str, default: str = "on") -> bool:
    return os.environ.get(name, default).lower() in ("0", "off", "false", "no")


def _float_env(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass(frozen=True)
class Limits:
    """What one request may carry, checked at the edge (core/limits.py) with a 400 (413 for
    bodies). The defaults keep every agent request well inside its 1 MiB frame header
    (guest/wire.py) and every argument inside Linux's 128 KiB per-string exec limit."""

    body_bytes: int = 8 << 20  # a JSON request body (file uploads are streamed, not bounded)
    command_bytes: int = (128 << 10) - 1  # a command line (bash -c's argument: MAX_ARG_STRLEN)
    env_bytes: int = 256 << 10  # all keys and values of one env map
    env_value_bytes: int = (128 << 10) - 1  # one env value
    env_keys: int = 1024
    stdin_bytes: int = 1 << 20  # a command's stdin given at its start, or one stdin write
    path_bytes: int = 4096  # a path, a cwd
    metadata_keys: int = 64
    metadata_key_bytes: int = 256
    metadata_value_bytes: int = 4096
    metadata_bytes: int = 32 << 10  # all keys and values
    ports: int = 64  # ports exposed per sandbox
    streams: int = 128  # command outputs and file reads streamed from one sandbox at once
    list_depth: int = 32  # files.list depth
    list_entries: int = 5000  # entries one files.list answers
    egress_rules: int = 256  # allow_out plus deny_out entries
    disk_mb: int = 65536  # a sandbox's disk (its quota) a create may ask for, MiB
    volume_mb: int = 10240  # the files of one volume (guest/volserve.py: EDQUOT past it), MiB
    # Per API key, over its sandboxes on one host (0: no limit of its own).
    key_sandboxes: int = 0  # sandboxes running or starting
    key_ports: int = 256  # ports exposed
    key_streams: int = 512  # streams open
    # Template builds through the API (core/builds.py): each build's VM and time, and the
    # builds one key's tenant may run at once (queued one at a time on a host).
    build_cpus: int = 4
    build_memory_mb: int = 8192
    build_disk_mb: int = 32768  # the free disk a build may ask for (minFreeDiskMb)
    build_seconds: int = 3600
    build_upload_bytes: int = 1 << 30  # one COPY's files, as uploaded and unpacked
    build_uploads_bytes: int = 4 << 30  # a tenant's kept uploads (the oldest go first)
    key_builds: int = 2

    @classmethod
    def from_env(cls) -> Limits:
        return cls(**{name: _int_env(f"SANDLOT_MAX_{name.upper()}", default)
                      for name, default in vars(cls()).items()})


@dataclass(frozen=True)
class Settings:
    """Paths and defaults. `images_dir` may be shared by several data dirs (tests do this)."""

    data_dir: Path = field(default_factory=default_data_dir)
    images_dir: Path | None = None
    store: str | None = None  # s3://BUCKET/PREFIX or a directory; default <data_dir>/store
    run_root: Path = Path("/run/sandlot")
    shm_root: Path = Path("/dev/shm/sandlot")
    accel: str | None = None  # SANDLOT_ACCEL: kvm|tcg; None: `accelerator` probes the host
    cpu_model: str | None = None  # SANDLOT_CPU_MODEL: the guests' CPU model (vmm/cpu.py)
    default_timeout: int = 300
    max_timeout: int = 24 * 3600
    reap_interval: float = 1.0
    pool_size: int = 2  # warm pool: VMs kept restored per template (runtime/pool.py); 0: off
    pool_templates: tuple[str, ...] = ("base",)
    cache_mb: int = field(default_factory=lambda: _mem_total_mb() // 4)
    gc_grace: float = 3600.0
    gc_interval: float = 600.0
    instance: str = ""  # SANDLOT_INSTANCE: several servers on one host (tests)
    confine: bool = True  # each QEMU unprivileged, seccomp, in a cgroup (vmm/jail.py)
    # seconds a command may run past its timeout before the host ends its request itself (a guest
    # too busy to enforce the timeout, or to answer at all)
    command_grace: float = 5.0
    stream_keepalive: float = 30.0  # seconds of silence before a command stream's keepalive
    # never handed out: new VMs and captures are refused (CapacityError) below these
    reserve_mem_mb: int = field(default_factory=lambda: max(512, _mem_total_mb() // 20))
    reserve_disk_mb: int = 1024
    disk_quota_mb: int = 2048  # a sandbox's disk unless its create asks (runtime/capacity.py)
    limits: Limits = field(default_factory=Limits)
    # several hosts (core/hosts.py): the shared database, who this host is, where it is reached
    database_url: str | None = None
    host_id: str | None = None  # default: <data_dir>/host-id, made once
    advertise_url: str | None = None  # default: set by the server from its bind address
    max_sandboxes: int = field(default_factory=lambda: max(4, _mem_total_mb() // 256))
    heartbeat_interval: float = 2.0
    metrics_interval: float = 5.0  # seconds between samples of each sandbox's usage
    host_timeout: float = 6.0
    # SANDLOT_E2B_DOMAIN: E2B's sandbox domain; `<port>-<sandbox id>.<domain>` reaches that
    # port of the sandbox (server/ports.py). None: no such names are served.
    e2b_domain: str | None = None
    # sandbox networking (runtime/network.py): SANDLOT_NETWORK (off: QEMU's user network, no
    # outbound access), SANDLOT_DNS (upstream resolvers; (): the host's), SANDLOT_NET_POOL,
    # SANDLOT_NET_TABLE (the host's nft table `inet <name>`: one per deployment or test run)
    network: bool = True
    dns_servers: tuple[str, ...] = ()
    net_pool: str = "10.200.0.0/16"
    net_table: str = "sandlot"
    api_key: str | None = None  # SANDLOT_API_KEY: an admin key the server adds at its start
    log_level: str = "INFO"  # SANDLOT_LOG
    console_dir: Path | None = None  # SANDLOT_CONSOLE_DIR: a built console (default console/dist)
    # lazy restore (runtime/lazy.py): an image this host lacks is served from the store as it
    # is read (SANDLOT_LAZY_RESTORE=off: fetched whole first), with this many background
    # fetches (SANDLOT_LAZY_PREFETCH; 0: only what is read)
    lazy_restore: bool = True
    lazy_prefetch: int = 8
    # a restore while its snapshot's RAM file is being written starts from the pages the
    # capture took (runtime/unwritten.py); SANDLOT_RESTORE_UNWRITTEN=off: it waits for the
    # file, whose pages every VM restored from it shares
    restore_unwritten: bool = True
    # image pulls (images/oci.py, images/egress.py): SANDLOT_REGISTRIES as given (None: not
    # set), the registries reached over plain HTTP, the registries' credentials file
    registries: str | None = None
    insecure_registries: tuple[str, ...] = ()
    registry_auth_file: str | None = None
    buildah_driver: str = "overlay"  # SANDLOT_BUILDAH_DRIVER: overlay or vfs
    ecr_endpoint: str | None = None  # SANDLOT_ECR_ENDPOINT (None: AWS's, by region)
    write_tracking: bool = True  # SANDLOT_WRITE_TRACKING (vmm/write_tracking.py)

    @functools.cached_property
    def accelerator(self) -> str:
        """`kvm` or `tcg`: `accel`, or SANDLOT_ACCEL, or what this host can run (probed
        once, when first asked: building Settings probes nothing)."""
        return self.accel or _accel_env() or detect_accel()

    @classmethod
    def from_env(cls, data_dir: Path | str | None = None) -> Settings:
        data = Path(data_dir) if data_dir else default_data_dir()
        images = os.environ.get("SANDLOT_IMAGES_DIR")
        tag = os.environ.get("SANDLOT_INSTANCE", "")
        run_root = Path("/run/sandlot" + (f"-{tag}" if tag else ""))
        shm_root = Path("/dev/shm/sandlot" + (f"-{tag}" if tag else ""))
        store = os.environ.get("SANDLOT_STORE") or os.environ.get("SANDLOT_STORE_DIR")
        pool = os.environ.get("SANDLOT_POOL_TEMPLATES", "base")
        return cls(data_dir=data, cpu_model=os.environ.get("SANDLOT_CPU_MODEL") or None,
                   images_dir=Path(images) if images else None,
                   store=store or None, run_root=run_root,
                   shm_root=shm_root, pool_size=_int_env("SANDLOT_POOL_SIZE", 2),
                   pool_templates=tuple(n.strip() for n in pool.split(",") if n.strip()),
                   cache_mb=_int_env("SANDLOT_CACHE_MB", _mem_total_mb() // 4),
                   gc_grace=float(_int_env("SANDLOT_GC_GRACE", 3600)),
                   gc_interval=float(_int_env("SANDLOT_GC_INTERVAL", 600)) or 600.0,
                   instance=tag,
                   confine=not _off("SANDLOT_CONFINE"),
                   command_grace=float(_int_env("SANDLOT_COMMAND_GRACE", 5)) or 5.0,
                   stream_keepalive=float(_int_env("SANDLOT_STREAM_KEEPALIVE", 30)) or 30.0,
                   reserve_mem_mb=_int_env("SANDLOT_RESERVE_MEM_MB",
                                           max(512, _mem_total_mb() // 20)),
                   reserve_disk_mb=_int_env("SANDLOT_RESERVE_DISK_MB", 1024),
                   disk_quota_mb=_int_env("SANDLOT_DISK_QUOTA_MB", 2048) or 2048,
                   limits=Limits.from_env(),
                   database_url=os.environ.get("SANDLOT_DATABASE_URL") or None,
                   host_id=os.environ.get("SANDLOT_HOST_ID") or None,
                   advertise_url=os.environ.get("SANDLOT_ADVERTISE_URL") or None,
                   max_sandboxes=_int_env("SANDLOT_MAX_SANDBOXES",
                                          max(4, _mem_total_mb() // 256)) or 1,
                   heartbeat_interval=_float_env("SANDLOT_HEARTBEAT", 2.0),
                   host_timeout=_float_env("SANDLOT_HOST_TIMEOUT", 6.0),
                   metrics_interval=_float_env("SANDLOT_METRICS_INTERVAL", 5.0),
                   e2b_domain=(os.environ.get("SANDLOT_E2B_DOMAIN") or "").strip(". ").lower()
                   or None,
                   accel=_accel_env(),
                   network=os.environ.get("SANDLOT_NETWORK", "on").lower()
                   not in ("off", "0", "no"),
                   dns_servers=tuple(s.strip() for s in os.environ.get("SANDLOT_DNS", "")
                                     .split(",") if s.strip()),
                   net_pool=os.environ.get("SANDLOT_NET_POOL", "10.200.0.0/16"),
                   net_table=os.environ.get("SANDLOT_NET_TABLE") or "sandlot",
                   api_key=os.environ.get("SANDLOT_API_KEY") or None,
                   log_level=os.environ.get("SANDLOT_LOG", "INFO"),
                   console_dir=Path(os.environ["SANDLOT_CONSOLE_DIR"])
                   if os.environ.get("SANDLOT_CONSOLE_DIR") else None,
                   lazy_restore=not _off("SANDLOT_LAZY_RESTORE"),
                   lazy_prefetch=_int_env("SANDLOT_LAZY_PREFETCH", 8),
                   restore_unwritten=not _off("SANDLOT_RESTORE_UNWRITTEN"),
                   registries=os.environ.get("SANDLOT_REGISTRIES"),
                   insecure_registries=tuple(
                       h.strip() for h in os.environ.get("SANDLOT_INSECURE_REGISTRIES", "")
                       .split(",") if h.strip()),
                   registry_auth_file=os.environ.get("SANDLOT_REGISTRY_AUTH_FILE") or None,
                   buildah_driver=os.environ.get("SANDLOT_BUILDAH_DRIVER") or "overlay",
                   ecr_endpoint=_url_env("SANDLOT_ECR_ENDPOINT"),
                   write_tracking=not _off("SANDLOT_WRITE_TRACKING"))

    def stable_host_id(self) -> str:
        """This host's id: SANDLOT_HOST_ID, or one made once and kept in the data dir."""
        if self.host_id:
            return self.host_id
        path = self.data_dir / "host-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            import secrets

            self.data_dir.mkdir(parents=True, exist_ok=True)
            host_id = "h-" + secrets.token_hex(4)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(host_id + "\n")
            os.replace(tmp, path)
            return host_id

    @property
    def images(self) -> Path:
        return self.images_dir or (self.data_dir / "images")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "sandlot.db"

    @property
    def store_url(self) -> str:
        return self.store or str(self.data_dir / "store")

    @property
    def disks_dir(self) -> Path:
        return self.data_dir / "disks"

    @property
    def hot_dir(self) -> Path:
        """Uncompressed snapshot files restores map: RAM must be on tmpfs to share pages."""
        return self.shm_root / "hot"

    def ensure(self) -> None:
        for d in (self.data_dir, self.images, self.disks_dir, self.run_root, self.hot_dir):
            d.mkdir(parents=True, exist_ok=True)
