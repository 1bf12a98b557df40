"""Named snapshots and worker pools: install once, save the snapshot under a name, load it by
name later (without the base sandbox), restore a pool of workers from it in parallel, restore
one with more memory, more CPUs and its own environment, then list and delete.

Seed scenario: "Snapshots" (microVM snapshots: save and load named snapshots, fork workers,
restore with overrides, list and delete). Uses the async SDK.
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import asyncio
import secrets
import sys

from sandlot import AsyncSandbox, AsyncSnapshot

# Stands in for `pip install -r requirements.txt` (no downloads in this example).
INSTALL = ("mkdir -p /app/site && printf 'numpy==1.26\\nrequests==2.32\\n' > /app/requirements.txt"
           " && for p in numpy requests; do mkdir -p /app/site/$p && echo \"VERSION = 1\" > "
           "/app/site/$p/__init__.py; done && echo installed > /app/.installed")


async def main() -> int:
    name = f"after-pip-install-{secrets.token_hex(3)}"
    # Build the base once and save its snapshot by name.
    async with await AsyncSandbox.create(timeout=300) as base:
        await base.commands.run(INSTALL, timeout=300)
        snap = await base.snapshot()
        await snap.wait(timeout=120)
        await snap.save_named(name)
    print(f"saved {snap.snapshot_id} as {name!r}; the base sandbox is gone")

    workers: list[AsyncSandbox] = []
    saved = await AsyncSnapshot.get(name)
    try:
        # Fork workers: each restore resumes the installed state, no setup phase.
        workers = list(await asyncio.gather(
            *(saved.restore(f"worker-{i}") for i in range(3))))
        for worker in workers:
            info = await worker.get_info()
            out = await worker.commands.run("cat /app/.installed")
            print(f"{info.metadata['name']}: {worker.sandbox_id} {out.stdout.strip()}")
            if out.stdout != "installed\n":
                return 1

        # Restore with overrides: memory, CPUs and an environment variable.
        custom = await saved.restore_with("custom", memory_mb=saved.info.memory_mb + 512,
                                          cpus=2, env={"WORKER_ID": "42"})
        workers.append(custom)
        out = (await custom.commands.run(
            "nproc; grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2; echo $WORKER_ID"
        )).stdout.split()
        print(f"custom: {custom.sandbox_id} cpus={out[0]} MemTotal={out[1]} kB "
              f"WORKER_ID={out[2]}")
        if out[0] != "2" or out[2] != "42" or int(out[1]) < 900 * 1024:
            return 1

        names = [s.name for s in await AsyncSnapshot.list()]
        print(f"{name!r} listed: {name in names}")
        if name not in names:
            return 1
        return 0
    finally:
        await asyncio.gather(*(w.kill() for w in workers))
        await AsyncSnapshot.delete(name)
        await saved.aclose()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
