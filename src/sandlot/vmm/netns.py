"""Code run inside a network namespace: a sandbox's, which `vmm.network` makes."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["NETNS_DIR", "run_in_netns"]

T = TypeVar("T")
NETNS_DIR = "/run/netns"  # where `ip netns` keeps the namespaces it names
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def run_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` in a new thread that has entered network namespace ``netns``.

    The thread exits afterwards, so nothing else ever runs in it. Sockets created by ``fn``
    stay in ``netns`` and can be used from any thread; processes it starts inherit ``netns``.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns {netns}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:  # handed to the calling thread
            error.append(e)

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
