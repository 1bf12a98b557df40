"""sandlot's HTTP server: the REST API under /v1 (and the E2B-compatible API)."""

from sandlot.server.app import create_app, run

__all__ = ["create_app", "run"]
