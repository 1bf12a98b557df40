"""sandlot's error tree, shared by core, server and SDK.

    SandlotError
    ├── InvalidArgumentError   400  bad input: caller's fault, retrying won't help
    │   ├── PayloadTooLargeError  413  a request body over the server's limit
    │   └── ImageError            400  an image reference, registry answer or Dockerfile
    │       │                          sandlot cannot use
    │       └── BuildStepError    400  a Dockerfile instruction failed (its output attached)
    ├── AuthenticationError    401  missing or wrong API key
    ├── NotFoundError          404  unknown sandbox, snapshot, template, process or path
    │   └── ImageNotFoundError    404  no such image (repository or tag) in its registry
    ├── ConflictError          409  a name already taken
    ├── InvalidStateError      409  the object is not in a state that allows the call
    ├── CommandTimeoutError    504  a command ran past its timeout and was killed
    ├── SandboxError           502  the sandbox failed (guest agent or VMM)
    │   ├── GuestError              the in-guest agent failed or went away
    │   └── VmmError                QEMU failed to start, load or answer
    ├── CapacityError          503  this host has no room for it now (memory, disk)
    ├── StorageError           500  snapshot data missing, corrupt, or not writable
    └── BuildError             500  a template build step failed

The server maps errors to HTTP by `status` in one handler and sends
``{"error": {"type", "message"}}``; the SDK raises the class named by ``type``.
"""

from __future__ import annotations

import json
import re
from typing import Any

HOST_PATH = "<host path>"
_ABSOLUTE = re.compile(r"(?<![\w.:/<-])/(?:[^\s'\"/,;()\[\]{}<>]+/)+[^\s'\",;()\[\]{}<>]*")


def hide_path(m: re.Match) -> str:
    """A matched path as a message may show it: HOST_PATH (a sentence's end kept)."""
    path = m.group(0)
    return HOST_PATH + path[len(path.rstrip(".:")):]


def without_paths(text: str) -> str:
    """`text` with every absolute path of two components or more replaced: what a message of
    the host's side (storage, VMM, builds) may show a client."""
    return _ABSOLUTE.sub(hide_path, text)


class SandlotError(Exception):
    """Root of every error sandlot raises."""

    status: int = 500

    def __init__(self, message: str = "", *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.message = message
        if cause is not None:
            self.__cause__ = cause


class InvalidArgumentError(SandlotError):
    status = 400


class PayloadTooLargeError(InvalidArgumentError):
    """A request body larger than the server accepts (`SANDLOT_MAX_BODY_BYTES`)."""

    status = 413


class ImageError(InvalidArgumentError):
    """An OCI image or Dockerfile sandlot cannot use: a malformed reference, a registry that
    refuses (credentials, TLS), an image without the files a sandbox needs."""


class BuildStepError(ImageError):
    """A Dockerfile instruction failed; the message names it and ends with its output."""


class AuthenticationError(SandlotError):
    status = 401


class PermissionDeniedError(AuthenticationError):
    """The key is valid but may not do this (an operator's call, made with a tenant's key)."""

    status = 403


class NotFoundError(SandlotError):
    status = 404


class ImageNotFoundError(NotFoundError):
    """The registry has no such repository or tag (or will not say, without credentials)."""


class ConflictError(SandlotError):
    status = 409


class InvalidStateError(SandlotError):
    """An object is in `current` state, but the call needs one of `allowed`."""

    status = 409

    def __init__(self, message: str = "", *, current: str | None = None,
                 allowed: tuple[str, ...] = ()) -> None:
        if not message and current is not None:
            message = f"state is {current}; this needs {' or '.join(allowed)}"
        super().__init__(message)
        self.current = current
        self.allowed = allowed


class CommandTimeoutError(SandlotError):
    status = 504


class SandboxError(SandlotError):
    status = 502


class GuestError(SandboxError):
    pass


class VmmError(SandboxError):
    pass


class CapacityError(SandlotError):
    """The host keeps a reserve of memory and disk it does not hand out; try again later,
    free something, or use another host."""

    status = 503


class HostUnavailableError(SandlotError):
    """The host that runs the sandbox did not answer (a deployment of several hosts); if it
    stays silent, its sandboxes are reported `lost`."""

    status = 503


class StorageError(SandlotError):
    status = 500


class BuildError(SandlotError):
    status = 500


ERRORS: dict[str, type[SandlotError]] = {
    cls.__name__: cls
    for cls in (
        SandlotError, InvalidArgumentError, PayloadTooLargeError, AuthenticationError,
        PermissionDeniedError,
        NotFoundError, ConflictError, InvalidStateError, CommandTimeoutError, SandboxError,
        CapacityError, HostUnavailableError,
        GuestError, VmmError, StorageError, BuildError, ImageError, BuildStepError,
        ImageNotFoundError,
    )
}


_STATUS_FALLBACK: dict[int, type[SandlotError]] = {
    400: InvalidArgumentError, 401: AuthenticationError, 403: AuthenticationError,
    404: NotFoundError, 422: InvalidArgumentError, 502: SandboxError,
}


def error_from_payload(payload: Any, status: int | None = None) -> SandlotError:
    """Build the error class named by an answer's ``{"type", "message"}``."""
    if not isinstance(payload, dict):
        payload = {}
    name = payload.get("type")
    message = str(payload.get("message") or name or "unknown error")
    cls = ERRORS.get(name) if isinstance(name, str) else None
    if cls is None:
        cls = _STATUS_FALLBACK.get(status or 0, SandlotError)
    error = cls(message)
    if status is not None:
        error.status = status
    return error


def error_from_answer(status: int, content: bytes) -> SandlotError:
    """The error an HTTP error answer of sandlot's API names (the SDK's, and a server's
    answer from another host)."""
    payload: Any = None
    try:
        payload = json.loads(content)
    except ValueError:
        pass
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return error_from_payload(payload["error"], status)
    text = content.decode("utf-8", "replace").strip()[:200]
    error = _STATUS_FALLBACK.get(status, SandlotError)(
        f"HTTP {status}" + (f": {text}" if text else ""))
    error.status = status
    return error
