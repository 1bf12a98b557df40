"""The peer measured in the same run: gVisor (runsc), via `bench/peer_gvisor.py`.

That module provides ``available() -> (bool, str)`` and ``run(n, workdir) -> dict`` with keys
such as ``restore_ms_p50``, ``fork8_wall_ms``, ``checkpoint_ms_p50``, or ``{"unavailable":
reason}``. Until it exists, or when runsc cannot run here, the peer figures are null and the
reason is reported.
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path


def run_peer(n: int, workdir: Path) -> dict:
    """The peer's figures, or ``{"unavailable": reason}``; never raises."""
    try:
        peer = importlib.import_module("peer_gvisor")
    except ModuleNotFoundError as e:
        if e.name != "peer_gvisor":
            return {"unavailable": f"bench/peer_gvisor.py failed to import: {e}"}
        return {"unavailable": "bench/peer_gvisor.py is not written yet"}
    try:
        ok, why = peer.available()
        if not ok:
            return {"unavailable": why}
        # The module's own work dir caches its rootfs between runs (a build takes ~1 minute).
        workdir = Path(getattr(peer, "DEFAULT_WORKDIR", workdir))
        workdir.mkdir(parents=True, exist_ok=True)
        result = dict(peer.run(n, workdir))
    except Exception as e:  # noqa: BLE001 - the peer failing must not sink the benchmark
        return {"unavailable": f"gVisor run failed: {type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=5)}
    result.setdefault("name", "gVisor (runsc)")
    return result
