"""The ``sandlot`` command line: run the server, build templates, and drive sandboxes and
snapshots through the REST API (with the sync SDK).

Local commands (``serve``, ``template``, ``keys``) work on ``--data-dir`` (env
``SANDLOT_DATA_DIR``, default /var/lib/sandlot). Client commands take ``--url`` and
``--api-key`` (env ``SANDLOT_URL``/``SANDLOT_API_KEY``). Commands that print objects take
``--json``. Failures print ``error: <message>`` to stderr and exit 1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from sandlot import Sandlot, SandlotError

DEFAULT_DATA_DIR = "/var/lib/sandlot"

_out = Console(highlight=False, soft_wrap=True)


# -- plumbing ------------------------------------------------------------------------------


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)


class _Group(click.Group):
    """Turns every failure below it into ``error: <message>`` and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except SandlotError as exc:
            _fail(exc.message or str(exc) or type(exc).__name__)
        except OSError as exc:
            _fail(str(exc))
        except Exception as exc:
            if os.environ.get("SANDLOT_DEBUG"):
                raise
            _fail(f"{type(exc).__name__}: {exc}")
        ctx.exit(1)


def _pairs(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", ctx, param)
        out[key] = value
    return out


def _env_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--env", "env", multiple=True, callback=_pairs, metavar="K=V",
                        help="Environment variable (repeatable).")(f)


def _metadata_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--metadata", "metadata", multiple=True, callback=_pairs, metavar="K=V",
                        help="Metadata entry (repeatable).")(f)


_json_option = click.option("--json", "as_json", is_flag=True,
                            help="Print machine-readable JSON.")

_data_dir_option = click.option(
    "--data-dir", type=click.Path(file_okay=False, path_type=Path), envvar="SANDLOT_DATA_DIR",
    default=DEFAULT_DATA_DIR, show_default=True, show_envvar=True,
    help="Where sandlot keeps its state.")


def _client(url: str | None, api_key: str | None) -> Sandlot:
    return Sandlot(url, api_key)


def _with_client(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--url``/``--api-key`` and pass an open `Sandlot` client as the first argument."""

    @functools.wraps(f)
    def wrapper(*args: Any, url: str | None, api_key: str | None, **kwargs: Any) -> Any:
        with _client(url, api_key) as client:
            return f(client, *args, **kwargs)

    wrapper = click.option("--api-key", envvar="SANDLOT_API_KEY", show_envvar=True,
                           help="API key.")(wrapper)
    wrapper = click.option("--url", envvar="SANDLOT_URL", show_envvar=True,
                           help="Server URL [default: http://127.0.0.1:7070].")(wrapper)
    return wrapper


def _plain(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if is_dataclass(obj) and not isinstance(obj, type):
        return json.loads(json.dumps(asdict(obj), default=str))
    if isinstance(obj, dict):
        return obj
    return json.loads(json.dumps(vars(obj), default=str))


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, str) and len(value) > 19 and value[10:11] == "T":
        return value[:19].replace("T", " ")  # ISO timestamp: drop sub-seconds and zone
    return str(value)


def _size(value: Any) -> str:
    if not isinstance(value, int):
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


_SANDBOX_COLUMNS = [("SANDBOX", "sandbox_id"), ("TEMPLATE", "template"), ("STATE", "state"),
                    ("MEMORY", "memory_mb"), ("CPUS", "cpus"), ("EXPIRES", "expires_at"),
                    ("SNAPSHOT", "snapshot_id"), ("METADATA", "metadata")]
_SNAPSHOT_COLUMNS = [("SNAPSHOT", "snapshot_id"), ("NAME", "name"), ("STATE", "state"),
                     ("SANDBOX", "sandbox_id"), ("SIZE", "size_bytes"),
                     ("STORED", "stored_bytes"), ("CREATED", "created_at"), ("ERROR", "error")]
_TEMPLATE_COLUMNS = [("NAME", "name"), ("HASH", "hash"), ("IMAGE", "image"),
                     ("MEMORY", "memory_mb"), ("CPUS", "cpus"), ("BUILT", "built_at")]
_PROCESS_COLUMNS = [("PID", "pid"), ("USER", "user"), ("CMD", "cmd")]
_HOST_COLUMNS = [("HOST", "id"), ("STATE", "state"), ("URL", "url"), ("SANDBOXES", "sandboxes"),
                 ("SLOTS", "slots"), ("CORES", "cores"), ("MEM FREE", "memory_free_mb"),
                 ("HEARTBEAT", "heartbeat_age_s")]


def _show(items: Any, columns: list[tuple[str, str]], as_json: bool) -> None:
    """Print one object (as KEY VALUE lines) or a list (as a table)."""
    if isinstance(items, list):
        rows = [_plain(item) for item in items]
        if as_json:
            _print_json(rows)
            return
        table = Table(box=None, pad_edge=False, header_style="bold")
        cells = [[_format(key, row.get(key)) for _, key in columns] for row in rows]
        for i, (header, key) in enumerate(columns):
            # Only free text is shortened to fit: ids, states and sizes are shown whole.
            wide = key in ("metadata", "error", "cmd")
            width = len(header) if wide else max([len(header)] + [len(c[i]) for c in cells])
            table.add_column(header, no_wrap=True, overflow="ellipsis" if wide else "fold",
                             min_width=width)
        for row in cells:
            table.add_row(*row)
        _out.print(table)
        return
    row = _plain(items)
    if as_json:
        _print_json(row)
        return
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in row.items():
        table.add_row(key, _format(key, value))
    _out.print(table)


def _format(key: str, value: Any) -> str:
    return _size(value) if key.endswith("_bytes") else _cell(value)


# -- commands ------------------------------------------------------------------------------


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sandlot")
def cli() -> None:
    """sandlot: self-hosted QEMU microVM sandboxes."""


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=7070, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: a free one the kernel picks; see --port-file).")
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the port it listens on to this file once it listens (with --port 0: "
                   "how a caller learns which port it got).")
@click.option("--database", metavar="URL", help="A postgresql:// URL shared by every host of a "
              "deployment (SANDLOT_DATABASE_URL); default SQLite under the data dir.")
@click.option("--advertise-url", metavar="URL", help="Where other hosts reach this one "
              "(SANDLOT_ADVERTISE_URL); default http://HOST:PORT.")
@_data_dir_option
def serve(host: str, port: int, port_file: Path | None, database: str | None,
          advertise_url: str | None, data_dir: Path) -> None:
    """Run the REST API server (SIGUSR1 prints every thread's stack to stderr)."""
    import contextlib
    import faulthandler
    import os
    import signal

    from sandlot.server import run

    if database:
        os.environ["SANDLOT_DATABASE_URL"] = database
    if advertise_url:
        os.environ["SANDLOT_ADVERTISE_URL"] = advertise_url
    with contextlib.suppress(ValueError, OSError, RuntimeError):  # stderr without a descriptor
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    run(host=host, port=port, data_dir=data_dir, port_file=port_file)


@cli.group(cls=_Group)
def hosts() -> None:
    """The hosts of a deployment (docs/cluster.md)."""


@hosts.command("list")
@_json_option
@_with_client
def hosts_list(client: Sandlot, as_json: bool) -> None:
    """List the hosts, with their state, capacity and load."""
    _show(client.hosts.list(), _HOST_COLUMNS, as_json)


@hosts.command("drain")
@click.argument("host_id")
@_json_option
@_with_client
def hosts_drain(client: Sandlot, host_id: str, as_json: bool) -> None:
    """Send no new sandboxes to HOST_ID; those it runs run to their end."""
    _show(client.hosts.drain(host_id), _HOST_COLUMNS, as_json)


@hosts.command("activate")
@click.argument("host_id")
@_json_option
@_with_client
def hosts_activate(client: Sandlot, host_id: str, as_json: bool) -> None:
    """Let a drained host take new sandboxes again."""
    _show(client.hosts.activate(host_id), _HOST_COLUMNS, as_json)


@cli.group(cls=_Group)
def template() -> None:
    """Build and manage templates on this host (no server needed)."""


@template.command("build")
@click.argument("args", nargs=-1, required=True, metavar="NAME_OR_SPEC | [CONTEXT] NAME")
@click.option("--image", "image_ref", metavar="REF",
              help="Build template NAME from this OCI image (e.g. python:3.12-slim).")
@click.option("-f", "--file", "dockerfile", type=click.Path(dir_okay=False, path_type=Path),
              help="Build template NAME from this Dockerfile (context: CONTEXT, default its "
                   "folder).")
@click.option("--build-arg", "build_args", multiple=True, callback=_pairs, metavar="K=V",
              help="A Dockerfile ARG (repeatable).")
@click.option("--insecure-registry", "insecure", multiple=True, metavar="HOST:PORT",
              help="Reach this registry over plain HTTP (repeatable; also "
                   "SANDLOT_INSECURE_REGISTRIES).")
@click.option("--creds", metavar="USER:PASSWORD", help="Registry credentials.")
@click.option("--authfile", type=click.Path(dir_okay=False), help="Registry auth file "
              "(default: the Docker and containers ones; SANDLOT_REGISTRY_AUTH_FILE).")
@click.option("--memory", "memory_mb", type=int, default=512, show_default=True,
              help="An image template's memory in MiB.")
@click.option("--cpus", type=int, default=1, show_default=True, help="An image template's vCPUs.")
@click.option("--disk-mb", type=int, help="An image template's disk (default: its files + 1 GiB).")
@_data_dir_option
@click.option("--force", is_flag=True, help="Rebuild even if a build with this hash exists.")
@_json_option
def template_build(args: tuple[str, ...], image_ref: str | None, dockerfile: Path | None,
                   build_args: dict[str, str], insecure: tuple[str, ...], creds: str | None,
                   authfile: str | None, memory_mb: int, cpus: int, disk_mb: int | None,
                   data_dir: Path, force: bool, as_json: bool) -> None:
    """Build a template: NAME_OR_SPEC (a built-in name or a spec file path), or NAME from an
    OCI image (--image REF) or a Dockerfile (-f Dockerfile [CONTEXT] NAME)."""
    from sandlot.config import Settings
    from sandlot.images.oci import Access

    pipeline = importlib.import_module("sandlot.images.pipeline")

    if image_ref and dockerfile:
        raise click.UsageError("give --image or -f, not both")
    settings = Settings.from_env(data_dir)
    access = Access.of((*settings.insecure_registries, *insecure), creds,
                       authfile or settings.registry_auth_file, settings.registries)
    sizes = {"memory_mb": memory_mb, "cpus": cpus, "disk_mb": disk_mb}
    if image_ref:
        if len(args) != 1:
            raise click.UsageError("usage: sandlot template build --image REF NAME")
        info = pipeline.pull_image_template(image_ref, args[0], settings=settings,
                                            access=access, force=force, **sizes)
    elif dockerfile:
        if len(args) not in (1, 2):
            raise click.UsageError("usage: sandlot template build -f Dockerfile [CONTEXT] NAME")
        context = Path(args[0]) if len(args) == 2 else None
        info = pipeline.dockerfile_template(
            dockerfile, context, args[-1], settings=settings, access=access,
            build_args=build_args, force=force,
            warn=lambda text: click.echo(f"warning: {text}", err=True), **sizes)
    else:
        if len(args) != 1:
            raise click.UsageError("usage: sandlot template build NAME_OR_SPEC")
        info = pipeline.build_template(args[0], data_dir, force)
    if as_json:
        _print_json(_plain(info))
    else:
        click.echo(f"template {info.name} ready ({info.hash})")


@template.command("list")
@_data_dir_option
@_json_option
def template_list(data_dir: Path, as_json: bool) -> None:
    """List the templates built on this host."""
    from sandlot.core.templates import list_templates

    _show(list(list_templates(data_dir)), _TEMPLATE_COLUMNS, as_json)


@template.command("rm")
@click.argument("name")
@_data_dir_option
def template_rm(name: str, data_dir: Path) -> None:
    """Remove template NAME."""
    from sandlot.core.templates import remove_template

    remove_template(name, data_dir)
    click.echo(f"removed template {name}")


@template.command("gc")
@_data_dir_option
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@_json_option
def template_gc(data_dir: Path, dry_run: bool, as_json: bool) -> None:
    """Remove template builds that no template, snapshot or running sandbox uses."""
    from sandlot.config import Settings
    from sandlot.core.templates import builds_in_use
    from sandlot.images.gc import collect_garbage

    settings = Settings.from_env(data_dir)
    removed = collect_garbage(settings, lambda: builds_in_use(settings), dry_run=dry_run)
    if as_json:
        _print_json({"removed": removed, "dry_run": dry_run})
    else:
        verb = "would remove" if dry_run else "removed"
        click.echo(f"{verb} {len(removed)} unused template builds"
                   + "".join(f"\n  {name}" for name in removed))


@cli.group(cls=_Group)
def store() -> None:
    """The store of snapshots and templates (SANDLOT_STORE, or <data dir>/store)."""


@store.command("gc")
@_data_dir_option
@click.option("--grace", type=float, default=None,
              help="Seconds an unreferenced chunk waits between the two passes "
                   "(default SANDLOT_GC_GRACE, 3600).")
@_json_option
def store_gc(data_dir: Path, grace: float | None, as_json: bool) -> None:
    """Free chunks no snapshot or template references. A chunk goes on the second run at
    least a grace period after the first found it unreferenced, so uploads and other servers
    sharing the store lose nothing."""
    import asyncio

    from sandlot.config import Settings
    from sandlot.storage.gc import collect_garbage
    from sandlot.storage.objects import open_store
    from sandlot.storage.store import Store

    settings = Settings.from_env(data_dir)
    stats = asyncio.run(collect_garbage(Store(open_store(settings.store_url)),
                                        settings.gc_grace if grace is None else grace))
    if as_json:
        _print_json(vars(stats))
    else:
        click.echo(f"{settings.store_url}: {stats.manifests} images, {stats.chunks} chunks; "
                   f"marked {stats.tombstoned} unreferenced, deleted {stats.deleted} "
                   f"({stats.deleted_bytes / 2**20:.1f} MiB)")


@cli.group(cls=_Group)
def keys() -> None:
    """Manage tenants and their API keys (docs/security.md): each key acts for one tenant
    and sees that tenant's sandboxes and snapshots only; admin keys see every tenant's."""


@keys.command("create")
@click.option("--tenant", help="Add the key to this tenant (made if new). Without it, the key "
                               "is the first of a new tenant.")
@click.option("--admin", is_flag=True, help="An operator's key: it sees every tenant's objects.")
@click.option("--e2b", "e2b_format", is_flag=True,
              help="In E2B's format (e2b_ and 40 hex digits), which E2B's SDKs check before "
                   "sending it; it works for sandlot's API too.")
@_data_dir_option
def keys_create(tenant: str | None, admin: bool, e2b_format: bool, data_dir: Path) -> None:
    """Create an API key and print it (it is shown only once; its tenant goes to stderr).
    With SANDLOT_DATABASE_URL set, in the deployment's database."""
    from sandlot.core.keys import create_key

    key, tenant = create_key(data_dir, tenant=tenant, admin=admin, e2b_format=e2b_format)
    click.echo(key)
    click.echo(f"tenant: {tenant}{' (admin)' if admin else ''}", err=True)


_KEY_COLUMNS = [("KEY", "key_id"), ("TENANT", "tenant"), ("ADMIN", "admin"),
                ("CREATED", "created_at")]


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_data_dir_option
def keys_list(as_json: bool, data_dir: Path) -> None:
    """The API keys (by id, never the key) and their tenants."""
    from sandlot.core.keys import list_keys

    rows = [{**vars(k), "created_at": datetime.fromtimestamp(k.created_at, UTC).isoformat()}
            for k in list_keys(data_dir)]
    _show(rows, _KEY_COLUMNS, as_json)


@keys.command("revoke")
@click.argument("key_id")
@_data_dir_option
def keys_revoke(key_id: str, data_dir: Path) -> None:
    """Revoke an API key by its id (`sandlot keys list`); servers refuse it within seconds."""
    from sandlot.core.keys import revoke_key

    revoke_key(key_id, data_dir)
    click.echo(f"revoked {key_id}")


@cli.group(cls=_Group)
def sandbox() -> None:
    """Create, list, run commands in, fork and kill sandboxes."""


@sandbox.command("create")
@click.option("--template", "template_name", default="base", show_default=True,
              help="Template to boot.")
@click.option("--snapshot", "snapshot_id", help="Restore from this snapshot instead.")
@click.option("--image", "image", metavar="REF", help="Start from this OCI image instead "
              "(pulled and built into a template on the server on first use).")
@click.option("--memory", "memory_mb", type=int, help="Memory in MiB.")
@click.option("--cpus", type=int, help="Number of vCPUs.")
@click.option("--disk", "disk_mb", type=int, help="Disk in MiB (its quota; default: the "
              "server's SANDLOT_DISK_QUOTA_MB).")
@click.option("--timeout", type=int, default=300, show_default=True,
              help="Seconds until the sandbox is killed.")
@_env_option
@_metadata_option
@click.option("--no-internet", is_flag=True, help="No outbound network.")
@_json_option
@_with_client
def sandbox_create(client: Sandlot, template_name: str, snapshot_id: str | None,
                   image: str | None, memory_mb: int | None, cpus: int | None,
                   disk_mb: int | None, timeout: int, env: dict[str, str],
                   metadata: dict[str, str], no_internet: bool, as_json: bool) -> None:
    """Start a sandbox."""
    with contextlib.ExitStack() as stack:
        if image and not as_json:  # a first create from an image pulls and builds it
            stack.enter_context(Console(stderr=True).status(
                f"creating from {image} (the first time: pulling and building it)"))
        sbx = client.sandboxes.create(template_name, snapshot_id=snapshot_id,
                                      memory_mb=memory_mb, cpus=cpus, env=env,
                                      timeout=timeout, metadata=metadata,
                                      internet=not no_internet, image=image,
                                      disk_mb=disk_mb)
    _show(sbx.info, _SANDBOX_COLUMNS, as_json)


@sandbox.command("list")
@_metadata_option
@click.option("--all", "include_stopped", is_flag=True, help="Include stopped sandboxes.")
@_json_option
@_with_client
def sandbox_list(client: Sandlot, metadata: dict[str, str], include_stopped: bool,
                 as_json: bool) -> None:
    """List sandboxes (optionally those whose metadata matches)."""
    _show(client.sandboxes.list(metadata or None, include_stopped=include_stopped),
          _SANDBOX_COLUMNS, as_json)


@sandbox.command("get")
@click.argument("sandbox_id")
@_json_option
@_with_client
def sandbox_get(client: Sandlot, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    _show(client.sandboxes.get_info(sandbox_id), _SANDBOX_COLUMNS, as_json)


def _write(stream: Any) -> Callable[[str], None]:
    def write(chunk: str) -> None:
        stream.write(chunk)
        stream.flush()
    return write


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=int, default=60, show_default=True,
              help="Seconds before the command is killed (0: no limit).")
@_env_option
@click.option("--cwd", help="Working directory.")
@click.option("--user", default="root", show_default=True, help="User to run as.")
@_with_client
def sandbox_exec(client: Sandlot, sandbox_id: str, cmd: tuple[str, ...], timeout: int,
                 env: dict[str, str], cwd: str | None, user: str) -> None:
    """Run CMD in a sandbox, streaming its output; exit with its exit code.

    \b
    sandlot sandbox exec sb-123 -- ls -la /tmp
    sandlot sandbox exec sb-123 -- 'echo $HOME | wc -c'
    """
    line = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    sbx = client.sandboxes.connect(sandbox_id)
    result = sbx.commands.run(line, timeout=timeout or None, env=env, cwd=cwd, user=user,
                              on_stdout=_write(sys.stdout), on_stderr=_write(sys.stderr))
    click.get_current_context().exit(result.exit_code)


@sandbox.command("shell")
@click.argument("sandbox_id")
@click.option("--cmd", default="/bin/bash -i -l", show_default=True,
              help="What to run on the terminal.")
@_env_option
@click.option("--cwd", help="Working directory.")
@click.option("--user", default="root", show_default=True, help="User to run as.")
@_with_client
def sandbox_shell(client: Sandlot, sandbox_id: str, cmd: str, env: dict[str, str],
                  cwd: str | None, user: str) -> None:
    """Open an interactive terminal in a sandbox; exit with its shell's exit code.

    Every key goes to the sandbox (Ctrl-C too); the terminal's size follows this window.
    Leave with `exit` or Ctrl-D.
    """
    from sandlot.shell import run_shell

    code = run_shell(client.sandboxes.connect(sandbox_id), cmd, env=env or None, cwd=cwd,
                     user=user)
    click.get_current_context().exit(code)


@sandbox.command("kill")
@click.argument("sandbox_id")
@_with_client
def sandbox_kill(client: Sandlot, sandbox_id: str) -> None:
    """Stop a sandbox."""
    if not client.sandboxes.kill(sandbox_id):
        raise SandlotError(f"sandbox {sandbox_id} not found (already gone?)")
    click.echo(f"killed {sandbox_id}")


@sandbox.command("pause")
@click.argument("sandbox_id")
@click.option("--filesystem-only", is_flag=True,
              help="Keep its files only; the resume boots it from its disk.")
@_json_option
@_with_client
def sandbox_pause(client: Sandlot, sandbox_id: str, filesystem_only: bool,
                  as_json: bool) -> None:
    """Keep a sandbox's whole state and stop its VM (`resume` brings it back)."""
    _show(client.sandboxes.pause(sandbox_id, memory=False if filesystem_only else None),
          _SANDBOX_COLUMNS, as_json)


@sandbox.command("resume")
@click.argument("sandbox_id")
@click.option("--timeout", type=int, help="New time to live, seconds.")
@click.option("--reboot", is_flag=True,
              help="Boot from its disk as it was at the pause, not from its memory.")
@_json_option
@_with_client
def sandbox_resume(client: Sandlot, sandbox_id: str, timeout: int | None, reboot: bool,
                   as_json: bool) -> None:
    """Bring a paused sandbox back exactly where it was, under its id."""
    _show(client.sandboxes.resume(sandbox_id, timeout, reboot=reboot).info, _SANDBOX_COLUMNS,
          as_json)


@sandbox.command("fork")
@click.argument("sandbox_id")
@click.option("--count", "-n", type=int, default=1, show_default=True, help="Children to start.")
@_json_option
@_with_client
def sandbox_fork(client: Sandlot, sandbox_id: str, count: int, as_json: bool) -> None:
    """Start COUNT copies of a running sandbox. Exits 1 if any child failed."""
    _show_fork(client.sandboxes.connect(sandbox_id).fork(count), as_json)


def _show_fork(children: Any, as_json: bool) -> None:
    _show([child.info for child in children], _SANDBOX_COLUMNS, as_json)
    for error in children.errors:
        _fail(error.message)
    if children.errors:
        click.get_current_context().exit(1)


@sandbox.command("rollback")
@click.argument("sandbox_id")
@click.argument("snapshot")
@_json_option
@_with_client
def sandbox_rollback(client: Sandlot, sandbox_id: str, snapshot: str, as_json: bool) -> None:
    """Reset a sandbox to SNAPSHOT (id or name), keeping its id."""
    sbx = client.sandboxes.connect(sandbox_id).rollback(snapshot)
    _show(sbx.info, _SANDBOX_COLUMNS, as_json)


@cli.group(cls=_Group)
def snapshot() -> None:
    """Create, list, restore and delete snapshots."""


@snapshot.command("create")
@click.argument("sandbox_id")
@click.option("--name", help="Name for the snapshot.")
@click.option("--filesystem-only", is_flag=True,
              help="Its files only (no memory): sandboxes made from it boot.")
@click.option("--wait", is_flag=True, help="Wait until it is ready.")
@click.option("--wait-timeout", type=float, default=600, show_default=True,
              help="Seconds to wait with --wait.")
@_json_option
@_with_client
def snapshot_create(client: Sandlot, sandbox_id: str, name: str | None, filesystem_only: bool,
                    wait: bool, wait_timeout: float, as_json: bool) -> None:
    """Snapshot a running sandbox."""
    snap = client.sandboxes.connect(sandbox_id).create_snapshot(name,
                                                                memory=not filesystem_only)
    if wait:
        snap.wait(timeout=wait_timeout)
    _show(snap.info, _SNAPSHOT_COLUMNS, as_json)


@snapshot.command("list")
@click.option("--sandbox", "sandbox_id", help="Only snapshots of this sandbox.")
@_json_option
@_with_client
def snapshot_list(client: Sandlot, sandbox_id: str | None, as_json: bool) -> None:
    """List snapshots."""
    _show(client.snapshots.list(sandbox_id), _SNAPSHOT_COLUMNS, as_json)


@snapshot.command("get")
@click.argument("id_or_name")
@_json_option
@_with_client
def snapshot_get(client: Sandlot, id_or_name: str, as_json: bool) -> None:
    """Show one snapshot."""
    _show(client.snapshots.get(id_or_name).info, _SNAPSHOT_COLUMNS, as_json)


@snapshot.command("rm")
@click.argument("id_or_name")
@_with_client
def snapshot_rm(client: Sandlot, id_or_name: str) -> None:
    """Delete a snapshot."""
    if not client.snapshots.delete(id_or_name):
        raise SandlotError(f"snapshot {id_or_name} not found")
    click.echo(f"deleted {id_or_name}")


def _restore_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The settings of a sandbox started from a snapshot (restore, fork)."""
    for option in reversed((
            click.option("--memory", "memory_mb", type=int,
                         help="Memory in MiB (can only grow)."),
            click.option("--cpus", type=int, help="Number of vCPUs."),
            click.option("--timeout", type=int, help="Seconds until a new sandbox is killed."),
            _env_option, _metadata_option, _json_option)):
        f = option(f)
    return f


@snapshot.command("restore")
@click.argument("id_or_name")
@_restore_options
@_with_client
def snapshot_restore(client: Sandlot, id_or_name: str, memory_mb: int | None,
                     cpus: int | None, timeout: int | None, env: dict[str, str],
                     metadata: dict[str, str], as_json: bool) -> None:
    """Start a new sandbox from a snapshot."""
    sbx = client.snapshots.restore(None, id_or_name, memory_mb=memory_mb, cpus=cpus,
                                   env=env or None, timeout=timeout, metadata=metadata or None)
    _show(sbx.info, _SANDBOX_COLUMNS, as_json)


@snapshot.command("fork")
@click.argument("id_or_name")
@click.option("--count", "-n", type=int, default=1, show_default=True,
              help="Sandboxes to start.")
@_restore_options
@_with_client
def snapshot_fork(client: Sandlot, id_or_name: str, count: int, memory_mb: int | None,
                  cpus: int | None, timeout: int | None, env: dict[str, str],
                  metadata: dict[str, str], as_json: bool) -> None:
    """Start COUNT independent sandboxes from a snapshot at once (no running parent needed),
    each with the settings given. Exits 1 if any failed."""
    snap = client.snapshots.get(id_or_name)
    _show_fork(snap.fork(count, memory_mb=memory_mb, cpus=cpus, env=env or None,
                         timeout=timeout, metadata=metadata or None), as_json)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``sandlot`` command."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="sandlot")


if __name__ == "__main__":
    main()
