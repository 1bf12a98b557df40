"""The ASGI app: REST /v1 with API-key auth, OpenAPI, one error handler, and `run()`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import sys
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException

from sandlot.config import Settings
from sandlot.core.service import Core
from sandlot.errors import SandlotError
from sandlot.runtime.base import Runtime
from sandlot.server import errors
from sandlot.server.auth import require_key
from sandlot.server.autoresume import AutoResume
from sandlot.server.body import BodyLimit
from sandlot.server.console import mount_console
from sandlot.server.e2b import router as e2b_router
from sandlot.server.e2b.state import start_e2b_state
from sandlot.server.forward import PEER_SECRET, ForwardToOwner, Peers
from sandlot.server.metrics import Metrics
from sandlot.server.metrics import router as metrics_router
from sandlot.server.ports import E2BNames, PortRoutes, new_transport
from sandlot.server.routes_builds import router as builds_router
from sandlot.server.routes_commands import STREAM_SCHEMAS
from sandlot.server.routes_commands import router as commands_router
from sandlot.server.routes_events import router as events_router
from sandlot.server.routes_files import router as files_router
from sandlot.server.routes_hosts import router as hosts_router
from sandlot.server.routes_pty import router as pty_router
from sandlot.server.routes_sandboxes import router as sandboxes_router
from sandlot.server.routes_snapshots import router as snapshots_router

VERSION = "0.1.0"


def default_runtime(settings: Settings) -> Runtime:
    """QEMU VMs, with networking unless SANDLOT_NETWORK=off (or not root)."""
    from sandlot.runtime.network import Networking
    from sandlot.runtime.qemu import QemuRuntime

    return QemuRuntime(settings, Networking.from_settings(settings))


def create_app(settings: Settings | None = None, *, runtime: Runtime | None = None,
               kill_on_shutdown: bool = False) -> FastAPI:
    """Build the app; the core starts (and recovers) in the lifespan. `runtime` is the
    machine layer (default: QEMU); tests pass runtime/fake.FakeRuntime."""
    settings = settings or Settings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        peers = Peers(settings.stable_host_id())
        core = Core(settings, runtime or default_runtime(settings), peers)
        await core.start(settings.advertise_url or "")
        if settings.api_key:
            await core.add_admin_key(settings.api_key)
        peers.token = await core.deployment_secret(PEER_SECRET)
        app.state.peers = peers
        await start_e2b_state(app.state, core)
        core.snapshots.on_ready = lambda rec: app.state.metrics.observe(
            "snapshot", (rec.ready_at - rec.created_at).total_seconds())
        app.state.port_transport = new_transport()
        app.state.core = core
        try:
            yield
        finally:
            await app.state.port_transport.aclose()
            await app.state.peers.close()
            await core.stop(kill_sandboxes=kill_on_shutdown)

    app = FastAPI(title="sandlot", version=VERSION, lifespan=lifespan)
    app.state.metrics = Metrics()
    errors.add_host_roots(settings.data_dir, settings.images, settings.run_root,
                          settings.shm_root, settings.store_url)
    app.add_exception_handler(SandlotError, errors.sandlot_error)
    app.add_exception_handler(RequestValidationError, errors.validation_error)
    app.add_exception_handler(HTTPException, errors.http_error)
    app.add_exception_handler(Exception, errors.unexpected_error)
    app.add_middleware(BodyLimit, limit=settings.limits.body_bytes)
    app.add_middleware(AutoResume, get_core=lambda: getattr(app.state, "core", None))
    # <port>-<sandbox id>.<domain>: to the sandbox's port (server/ports.py)
    app.add_middleware(PortRoutes, get_core=lambda: getattr(app.state, "core", None))
    app.add_middleware(ForwardToOwner, get_core=lambda: getattr(app.state, "core", None))
    app.add_middleware(E2BNames)  # api.<domain>, 49983-<sandbox id>.<domain>: E2B's URLs
    auth = [Depends(require_key)]
    for router in (sandboxes_router, commands_router, files_router, snapshots_router,
                   hosts_router, events_router, builds_router):
        app.include_router(router, dependencies=auth)
    app.include_router(pty_router)  # a WebSocket: its key comes in its first message
    app.include_router(e2b_router)  # E2B compatibility under /e2b, own auth (docs/e2b.md)
    app.include_router(metrics_router)  # Prometheus, unauthenticated like /health
    mount_console(app, settings.console_dir)  # static files; it signs in with a key (/v1)

    def openapi() -> dict:
        """FastAPI's schema, plus the models the NDJSON streams are made of."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in STREAM_SCHEMAS:
                components.setdefault(model.__name__, model.model_json_schema(
                    ref_template="#/components/schemas/{model}"))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health", tags=["health"])
    async def health(request: Request) -> dict:
        """Liveness, the warm pool's state per template (ready, claimed, misses), and whether
        the start-up upload of this host's templates to a new store is over."""
        core = getattr(request.app.state, "core", None)
        pool = core.pool_stats() if core is not None else {}
        stored = core.templates_stored if core is not None else False
        return {"status": "ok", "version": VERSION, "pool": pool, "templates_stored": stored}

    return app


def run(host: str = "127.0.0.1", port: int = 7070, data_dir: Path | str | None = None,
        port_file: Path | str | None = None) -> None:
    """Serve until interrupted. Sandboxes outlive a server restart and are re-adopted.

    It binds its socket itself: with `port` 0 the kernel picks a free one, which it then
    advertises, logs, and writes to `port_file` (if given) once it listens."""
    import uvicorn

    settings = Settings.from_env(data_dir)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("qemu.qmp").setLevel(logging.WARNING)  # it logs every disconnect
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every forwarded request
    sock = listen(host, port)
    port = sock.getsockname()[1]
    if not settings.advertise_url:
        name = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
        name = f"[{name}]" if ":" in name else name
        settings = dataclasses.replace(settings, advertise_url=f"http://{name}:{port}")
    logging.getLogger(__name__).info("listening on %s port %d (advertised as %s)", host, port,
                                     settings.advertise_url)
    if port_file is not None:
        write_port(Path(port_file), port)
    app = create_app(settings)
    # asyncio's own loop, not uvloop: uvloop spawns processes (every QEMU) with a fork that
    # runs Python in the child, which in a process with busy threads (S3 client, executors)
    # now and then never reached exec and blocked the server's loop for good.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="asyncio",
                                           timeout_graceful_shutdown=5))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    if not server.started:  # the app did not start (its error is logged): as `uvicorn.run`
        sys.exit(3)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port the kernel picks) and listening.

    Made as asyncio makes the one uvicorn binds itself, protocol named (IPPROTO_TCP): asyncio
    turns Nagle's algorithm off (TCP_NODELAY) only on connections accepted from a socket whose
    `proto` says TCP, and `socket.create_server` leaves it 0. With Nagle on, the second part
    of an answer (uvicorn writes a head, then a body) waits for the client to acknowledge the
    first: a connection closed meanwhile loses it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host} port {port}: {exc.strerror}") from exc
    return sock


def write_port(path: Path, port: int) -> None:
    """`port` into `path`, whole or not at all (a reader polls it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(f"{port}\n")
    part.replace(path)
