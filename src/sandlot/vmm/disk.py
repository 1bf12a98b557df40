"""qcow2 disks: overlays on a backing image, and flattening a chain onto its base."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from sandlot.errors import VmmError

QEMU_IMG = "qemu-img"


async def _qemu_img(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        QEMU_IMG, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode:
        raise VmmError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


async def create_overlay(path: Path, backing: Path, backing_fmt: str, size: int) -> None:
    """A new empty qcow2 on `backing` (not opened: -u, so a busy backing file is fine)."""
    await _qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", str(backing), "-F", backing_fmt,
                    "-o", "cluster_size=65536", str(path), str(size))


async def flatten_onto(src: Path, dst: Path, base: Path, base_fmt: str) -> None:
    """Copy `src`'s own layer (not its backing chain) into a new qcow2 backed by `base`.

    `src`'s backing file must have the same content as `base` (qemu-img convert -B copies
    only the top layer).
    """
    tmp = dst.with_suffix(".tmp")
    await _qemu_img("convert", "-U", "-q", "-O", "qcow2", "-B", str(base), "-F", base_fmt,
                    "-o", "cluster_size=65536", str(src), str(tmp))
    tmp.replace(dst)


async def flatten_pair(top: Path, lower: Path, dst: Path) -> None:
    """One qcow2 holding `lower`'s layer with `top`'s written over it, on `lower`'s backing.

    `top` is a frozen overlay whose backing is `lower`; `lower` is a snapshot disk whose
    backing is the root filesystem. The result keeps a snapshot's disk at two layers (root
    filesystem + its own), however long its history. Neither input is changed.
    """
    tmp = dst.with_suffix(".tmp")
    merged_top = dst.with_suffix(".top")
    try:
        await asyncio.to_thread(shutil.copyfile, lower, tmp)
        await asyncio.to_thread(shutil.copyfile, top, merged_top)
        await _qemu_img("rebase", "-u", "-b", str(tmp), "-F", "qcow2", str(merged_top))
        await _qemu_img("commit", "-q", str(merged_top))
        tmp.replace(dst)
    finally:
        merged_top.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


async def merge_below_top(machine, base_file: Path, timeout: float = 600) -> None:
    """Copy the layers between `machine`'s top disk node and `base_file` into the top node
    (QMP block-stream), so its backing chain is top <- base_file again; the merged layers are
    then unused. Runs while the guest runs."""
    nodes = await machine.execute("query-named-block-nodes", {"flat": True})
    base = next((n["node-name"] for n in nodes
                 if n.get("drv") == "qcow2" and n.get("file") == str(base_file)), None)
    if base is None:
        raise VmmError(f"no disk node for {base_file}")
    job = f"merge-{machine.top_node}"
    await machine.execute("block-stream", {"job-id": job, "device": machine.top_node,
                                           "base-node": base})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(j.get("device") == job or j.get("id") == job
              for j in await machine.execute("query-block-jobs")):
        if loop.time() > deadline:
            raise VmmError(f"block-stream {job} did not finish in {timeout}s")
        await asyncio.sleep(0.02)
