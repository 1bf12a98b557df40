"""A short tour: create a sandbox, snapshot it while it runs, fork it, restore the snapshot.

Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment (`make demo` sets both).
"""

import time

from sandlot import Sandbox


def main() -> None:
    t = time.perf_counter()
    sbx = Sandbox.create(template="base", timeout=120)
    ms = (time.perf_counter() - t) * 1000
    print(f"created {sbx.sandbox_id} in {ms:.0f} ms (a restore, not a boot)")
    try:
        sbx.commands.run("python3 -c 'import os,time; "
                         "open(\"/tmp/token\",\"w\").write(os.urandom(4).hex()); "
                         "time.sleep(10**6)' >/dev/null 2>&1 &")
        sbx.files.write("/home/user/state.txt", "baseline\n")
        token = sbx.commands.run("for i in $(seq 100); do [ -s /tmp/token ] && break; "
                                 "sleep 0.1; done; cat /tmp/token").stdout
        print(f"a background process wrote token {token}")

        t = time.perf_counter()
        snap = sbx.create_snapshot(name=f"demo-{sbx.sandbox_id}")
        snap.wait(timeout=120)
        info = snap.info
        print(f"snapshot {snap.snapshot_id} ready in {(time.perf_counter() - t) * 1000:.0f} ms; "
              f"the sandbox paused {info.pause_ms} ms; stored {info.stored_bytes / 2**20:.1f} MiB")

        t = time.perf_counter()
        children = sbx.fork(count=3)
        print(f"forked {len(children)} children in {(time.perf_counter() - t) * 1000:.0f} ms")
        for i, child in enumerate(children):
            child.commands.run(f"echo branch-{i} > /home/user/state.txt")
        for child in children:
            out = child.commands.run("cat /home/user/state.txt; "
                                     "pgrep -f 'time.sleep' >/dev/null && echo process-alive")
            print(f"  {child.sandbox_id}: {out.stdout.split()}")
            child.kill()

        sbx.commands.run("rm /home/user/state.txt")
        sbx.rollback(snap)
        print(f"rolled back {sbx.sandbox_id}: state.txt = "
              f"{sbx.files.read('/home/user/state.txt').strip()!r}")

        t = time.perf_counter()
        restored = snap.restore()
        print(f"restored the snapshot into {restored.sandbox_id} in "
              f"{(time.perf_counter() - t) * 1000:.0f} ms; token = "
              f"{restored.commands.run('cat /tmp/token').stdout}")
        restored.kill()
        snap.remove()
    finally:
        sbx.kill()


if __name__ == "__main__":
    main()
