"""`break.py crash`: SIGKILL the server at random points of a snapshot, an upload, a fork and a
restore, restart it, and check what it left: every `ready` snapshot restores with the marker
file and the in-memory token written before it; no orphaned QEMU, run or disk directory,
network namespace, VM uid, mount table, cgroup or hot-cache entry; the source sandbox is
running and answers, or is cleanly gone; the next, uninterrupted snapshot of it succeeds."""

from __future__ import annotations

import random
import secrets
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _break import census, describe, finish, make_server, orphans, typed
from sandlot import NotFoundError, Sandbox, SandlotError, Snapshot

OPS = ("snapshot", "upload", "fork", "restore")
HOLDER = ("nohup python3 -c 'import time; token = \"{token}\"; time.sleep(10**9)' "
          ">/dev/null 2>&1 & echo $! > /root/holder.pid")
CHECK = "cat /root/marker; echo; tr '\\0' ' ' < /proc/$(cat /root/holder.pid)/cmdline"


class Source:
    """The sandbox the loop snapshots and forks: a marker file and a process whose argv (in
    its memory) holds a token."""

    def __init__(self, kw: dict) -> None:
        self.kw = kw
        self.sbx = Sandbox.create(**kw, timeout=3600)
        self.token = secrets.token_hex(8)
        self.sbx.commands.run(HOLDER.format(token=self.token), check=True)
        self.marker = ""

    def mark(self) -> str:
        self.marker = secrets.token_hex(6)
        self.sbx.files.write("/root/marker", self.marker)
        return self.marker


def state_of(sbx: Sandbox) -> tuple[str, str]:
    """(marker, holder argv) of a sandbox, or raises."""
    out = sbx.commands.run(CHECK, timeout=60)
    lines = out.stdout.split("\n", 1)
    return lines[0], lines[1] if len(lines) > 1 else ""


def timed_snapshot(sbx: Sandbox, timing: dict[str, list[float]]) -> Snapshot:
    """A snapshot, waited for; how long it captured and uploaded go to `timing`."""
    t0 = time.monotonic()
    snap = sbx.create_snapshot()
    while snap.refresh().state == "creating":
        time.sleep(0.02)
    t1 = time.monotonic()
    snap.wait(timeout=300)
    timing["capture"].append(t1 - t0)
    timing["upload"].append(time.monotonic() - t1)
    return snap


def verify_restore(kw: dict, snap_id: str, want: tuple[str, str]) -> str | None:
    """Restore `snap_id`; None if it has the marker and token it was taken with, else why."""
    try:
        sbx = Snapshot.get(snap_id, **kw).restore()
    except SandlotError as e:
        return f"restore of {snap_id} failed: {describe(e)}"
    try:
        marker, argv = state_of(sbx)
        if marker != want[0] or want[1] not in argv:
            return f"{snap_id}: marker {marker!r} (want {want[0]!r}), holder {argv[:80]!r}"
        return None
    except SandlotError as e:
        return f"{snap_id}: restored but does not answer: {describe(e)}"
    finally:
        try:
            sbx.kill()
        except SandlotError:
            pass


def run(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="sandlot-break-crash-"))
    s3 = None
    env: dict[str, str] = {}
    if args.s3:
        from sandlot.testing import S3Server

        s3 = S3Server(root / "s3")
        s3.start()
        env = {**s3.env, "SANDLOT_STORE": s3.url("crash")}
    srv = make_server(root, "k", **env)
    srv.start(timeout=300)  # a new S3 store: the templates are published first
    kw = srv.client_kwargs()
    t_start = time.monotonic()
    expect: dict[str, tuple[str, str]] = {}  # snapshot id -> (marker, token) it must restore
    verified: set[str] = set()
    result: dict = {"iterations": [], "kills": {op: 0 for op in OPS}}
    failures: list[str] = []  # anything the loop must not see
    restarts: list[float] = []
    try:
        src = Source(kw)
        # Calibrate the random points: each operation, uninterrupted (`--calibrate` times); every
        # restart's uninterrupted snapshot and restore add to these (the last five count).
        timing: dict[str, list[float]] = {"capture": [], "upload": [], "fork": [],
                                          "restore": []}
        for _ in range(args.calibrate):
            src.mark()
            snap = timed_snapshot(src.sbx, timing)
            expect[snap.snapshot_id] = (src.marker, src.token)
            t0 = time.monotonic()
            for kid in src.sbx.fork(args.fork):
                kid.kill()
            timing["fork"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            snap.restore().kill()
            timing["restore"].append(time.monotonic() - t0)
        result["calibration_s"] = {k: [round(x, 2) for x in v] for k, v in timing.items()}
        print(f"calibration (s): {result['calibration_s']}", flush=True)

        def typical(what: str) -> float:
            return statistics.median(timing[what][-5:])

        # An upload the loop means to cut that was done before the kill halves the window of
        # the next (the uninterrupted snapshots after a restart upload slower than the rest).
        upload_scale = 1.0
        per_op = -(-args.iterations // len(OPS))
        seen = dict.fromkeys(OPS, 0)

        def point(op: str) -> float:
            """A random point in [0, 1), stratified: the n-th kill of an operation falls in
            the n-th of `per_op` equal slices of its duration."""
            seen[op] += 1
            return (seen[op] - 1 + rng.random()) / per_op

        for i in range(1, args.iterations + 1):
            op = OPS[(i - 1) % len(OPS)]
            it: dict = {"i": i, "op": op}
            outcome: dict = {}
            snap_id = None
            if op in ("snapshot", "upload"):
                marker = src.mark()
                snap = src.sbx.create_snapshot()
                snap_id = it["snapshot"] = snap.snapshot_id
                expect[snap_id] = (marker, src.token)
                if op == "upload":
                    deadline = time.monotonic() + 120
                    while snap.refresh().state == "creating" and time.monotonic() < deadline:
                        time.sleep(0.02)
                    it["state_at_kill_window"] = snap.state
                    delay = point(op) * typical("upload") * upload_scale
                else:  # while it captures (the call returns at once; the capture runs on)
                    delay = point(op) * typical("capture") * 1.2
                call = None
            else:
                if op == "fork":
                    src.mark()
                    delay = point(op) * typical("fork")

                    def call(out=outcome, src=src) -> None:
                        kids = src.sbx.fork(args.fork)
                        out["children"] = [k.sandbox_id for k in kids]
                        out["child_errors"] = [describe(e) for e in kids.errors]
                else:
                    snap_id = rng.choice(sorted(verified))
                    delay = point(op) * typical("restore")

                    def call(out=outcome, sid=snap_id) -> None:
                        out["restored"] = Snapshot.get(sid, **kw).restore().sandbox_id
            thread = None
            if call is not None:
                def guarded(fn=call, out=outcome) -> None:
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001 - the kill cuts it off
                        out["error"] = describe(e)
                        out["typed"] = typed(e)
                thread = threading.Thread(target=guarded, daemon=True)
                thread.start()
            time.sleep(delay)
            it["killed_after_s"] = round(delay, 3)
            if snap_id and op in ("snapshot", "upload"):
                try:
                    it["state_at_kill"] = Snapshot.get(snap_id, **kw).state
                except SandlotError as e:
                    it["state_at_kill"] = describe(e)
            srv.stop(signal.SIGKILL)
            result["kills"][op] += 1
            if op == "upload" and it.get("state_at_kill") == "ready":
                upload_scale /= 2
            if thread is not None:
                thread.join(120)
                it["call"] = dict(outcome)
            t0 = time.monotonic()
            srv.start(timeout=120)
            restarts.append(time.monotonic() - t0)
            it["restart_s"] = round(restarts[-1], 2)
            it.update(check(kw, srv, src, expect, verified, outcome, failures, it, timing))
            if it.get("source") != "running":
                src = Source(kw)
            result["iterations"].append(it)
            print(f"{i}/{args.iterations} {op:8} killed at {delay:5.2f} s: "
                  f"{ {k: v for k, v in it.items() if k not in ('i', 'op', 'call')} }",
                  flush=True)

        # The end: every ready snapshot restores once more, with its marker and token.
        ready = [s.snapshot_id for s in Snapshot.list(**kw) if s.state == "ready"]
        final_bad = [m for sid in ready if sid in expect
                     and (m := verify_restore(kw, sid, expect[sid])) is not None]
        failures += [f"final: {m}" for m in final_bad]
        result["final"] = {"ready_snapshots": len(ready), "restore_failures": final_bad}
        # A clean stop after killing every sandbox leaves no QEMU, namespace, uid or cgroup.
        for s in Sandbox.list(**kw):
            Sandbox.connect(s.sandbox_id, **kw).kill()
        srv.stop()
        left = {k: sorted(v) for k, v in census(srv).items() if v and k != "hot_entries"}
        result["after_clean_stop"] = left
        if left:
            failures.append(f"after kill-all and a clean stop: {left}")
    finally:
        finish(srv, args.keep)
        if s3 is not None:
            s3.stop()
            if not args.keep:
                shutil.rmtree(s3.root / "data", ignore_errors=True)
    states = [it.get("snapshot_after") for it in result["iterations"] if "snapshot_after" in it]
    result.update({
        "args": vars(args), "store": "s3 (SeaweedFS)" if args.s3 else "local directory",
        "seconds": round(time.monotonic() - t_start),
        "restart_s": {"max": round(max(restarts), 2) if restarts else None,
                      "mean": round(sum(restarts) / len(restarts), 2) if restarts else None},
        "snapshots_ready_after_kill": states.count("ready"),
        "snapshots_failed_after_kill": states.count("failed"),
        "ready_restored_ok": len(verified),
        "failures": failures, "server_log": str(srv.log_path)})
    its = result["iterations"]
    result["summary"] = {
        "kills": result["kills"], "seconds": result["seconds"],
        "snapshot state when killed": {st: sum(it.get("state_at_kill") == st for it in its)
                                       for st in ("creating", "uploading", "ready")},
        "interrupted snapshots ready / failed": (result["snapshots_ready_after_kill"],
                                                 result["snapshots_failed_after_kill"]),
        "ready snapshots restored with marker and token": len(verified),
        "ready snapshots failing to restore": sum("restore" in f or "marker" in f
                                                  for f in failures),
        "iterations with orphans": sum("orphans" in it for it in its),
        "source running / gone after restart": (
            sum(it.get("source") == "running" for it in its),
            sum(str(it.get("source", "")).startswith("gone") for it in its)),
        "next snapshot failed": sum(it.get("next_snapshot") not in (None, "ready")
                                    for it in its),
        "restart s (mean, max)": (result["restart_s"]["mean"], result["restart_s"]["max"]),
        "failures": len(failures)}
    return result


def check(kw, srv, src: Source, expect, verified: set[str], outcome: dict,
          failures: list[str], it: dict, timing: dict[str, list[float]]) -> dict:
    out: dict = {}
    # 1. Snapshots: none stuck; every new ready one restores with its marker and token.
    for s in Snapshot.list(**kw):
        if s.state in ("creating", "uploading"):
            failures.append(f"it {it['i']}: snapshot {s.snapshot_id} still {s.state} "
                            "after the restart")
        if s.snapshot_id in expect and s.snapshot_id not in verified and s.state == "ready":
            bad = verify_restore(kw, s.snapshot_id, expect[s.snapshot_id])
            if bad:
                failures.append(f"it {it['i']}: {bad}")
            else:
                verified.add(s.snapshot_id)
        if s.snapshot_id == it.get("snapshot"):
            out["snapshot_after"] = s.state
    # 2. The source: running and answering with its marker and token, or cleanly gone.
    live = {s.sandbox_id for s in Sandbox.list(**kw)}
    if src.sbx.sandbox_id in live:
        try:
            marker, argv = state_of(src.sbx)
            out["source"] = "running"
            if marker != src.marker or src.token not in argv:
                failures.append(f"it {it['i']}: source has marker {marker!r}, want "
                                f"{src.marker!r}; holder {argv[:80]!r}")
        except SandlotError as e:
            out["source"] = "listed, not answering"
            failures.append(f"it {it['i']}: source listed but not answering: {describe(e)}")
            try:
                src.sbx.kill()
            except SandlotError:
                pass
    else:
        try:
            info = Sandbox.connect(src.sbx.sandbox_id, **kw).get_info()
            out["source"] = f"gone ({info.state})"
            if info.state not in ("stopped", "failed"):
                failures.append(f"it {it['i']}: source not listed but {info.state}")
        except NotFoundError:
            out["source"] = "gone (not found)"
    # 3. Sandboxes the interrupted call made (fork children, a restored one): answering with
    # the state they were made from, then killed.
    made = [i for i in outcome.get("children", []) + [outcome.get("restored")] if i]
    survivors = [s for s in Sandbox.list(**kw) if s.sandbox_id != src.sbx.sandbox_id]
    out["other_sandboxes_after"] = len(survivors)
    for s in survivors:
        sbx = Sandbox.connect(s.sandbox_id, **kw)
        try:
            marker, _ = state_of(sbx)
            if not marker:
                failures.append(f"it {it['i']}: {s.sandbox_id} answers without a marker")
        except SandlotError as e:
            failures.append(f"it {it['i']}: survivor {s.sandbox_id} "
                            f"({'made by the call' if s.sandbox_id in made else 'earlier'}) "
                            f"not answering: {describe(e)}")
        try:
            sbx.kill()
        except SandlotError:
            pass
    # 4. The next, uninterrupted snapshot of the source succeeds (if it is still there).
    if out.get("source") == "running":
        src.mark()
        try:
            snap = timed_snapshot(src.sbx, timing)
            t0 = time.monotonic()
            bad = verify_restore(kw, snap.snapshot_id, (src.marker, src.token))
            timing["restore"].append(time.monotonic() - t0)
            out["next_snapshot"] = "ready" if bad is None else "bad"
            if bad:
                failures.append(f"it {it['i']}: next snapshot: {bad}")
            snap.remove()
        except SandlotError as e:
            out["next_snapshot"] = describe(e)[:120]
            failures.append(f"it {it['i']}: the next snapshot after the restart failed: "
                            f"{describe(e)}")
    # 5. Nothing left over (a second look after 3 s, to let the restart's cleanup finish).
    left = orphans(srv, kw)
    if left:
        time.sleep(3)
        left = orphans(srv, kw)
    if left:
        out["orphans"] = left
        failures.append(f"it {it['i']}: left over after the restart: {left}")
    return out
