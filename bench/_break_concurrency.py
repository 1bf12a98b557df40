"""`break.py concurrency`: calls that race. N creates at once; fork calls on one parent while it
is being snapshotted; a snapshot deleted while a restore from it runs. Every call must succeed
or fail with a typed error (a `SandlotError` subclass the server named), every sandbox made
must answer with the state it was made from, every `ready` snapshot must restore, and nothing
may be left over once the sandboxes are gone."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path

from _break import Calls, describe, finish, make_server, orphans, stats_ms
from _break_crash import Source, state_of
from sandlot import NotFoundError, Sandbox, SandlotError, Snapshot


def together(fns: list) -> list:
    """Run every fn in a thread of its own, released at once; their results in order."""
    barrier = threading.Barrier(len(fns))
    out: list = [None] * len(fns)

    def go(i: int, fn) -> None:
        barrier.wait()
        out[i] = fn()

    threads = [threading.Thread(target=go, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def run(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="sandlot-break-conc-"))
    srv = make_server(root, "c")
    srv.start()
    kw = srv.client_kwargs()
    t_start = time.monotonic()
    failures: list[str] = []
    result: dict = {}
    try:
        # 1. N creates at once.
        calls = Calls()
        lat: list[float] = []

        def create():
            t0 = time.monotonic()
            sbx = calls.record("create", Sandbox.create, **kw, timeout=600)
            if sbx is not None:
                lat.append(time.monotonic() - t0)
            return sbx

        t0 = time.monotonic()
        made = [s for s in together([create] * args.creates) if s is not None]
        wall = time.monotonic() - t0
        answering = sum(calls.record("run", lambda s=s: s.commands.run("true", check=True))
                        is not None for s in made)
        ids = {s.sandbox_id for s in made}
        if len(ids) != len(made):
            failures.append(f"creates at once: {len(made)} sandboxes, {len(ids)} ids")
        for s in made:
            calls.record("kill", s.kill)
        result["creates"] = {"n": args.creates, "created": len(made), "answering": answering,
                             "wall_s": round(wall, 2), "latency": stats_ms(lat),
                             **calls.to_dict()}
        failures += [f"creates: {u}" for u in calls.untyped]
        print(f"creates at once: {result['creates']}", flush=True)

        # 2. Forks of one parent while it is being snapshotted (and a second snapshot call).
        src = Source(kw)
        expect: dict[str, tuple[str, str]] = {}
        rounds = []
        for r in range(args.rounds):
            calls = Calls()
            marker = src.mark()
            snaps: list = []

            def snapshot(calls=calls, snaps=snaps):
                snap = calls.record("snapshot", src.sbx.create_snapshot)
                if snap is not None:
                    snaps.append(snap)
                    calls.record("snapshot wait", snap.wait, timeout=300)
                return snap

            def fork(calls=calls):
                kids = calls.record("fork", src.sbx.fork, 1)
                if kids is not None:
                    for e in kids.errors:
                        calls.error("fork child", e)
                return list(kids or [])

            delays = [0.0] + [rng.uniform(0, 0.6) for _ in range(args.forks)] + [0.3]

            def later(fn, d):
                return lambda: (time.sleep(d), fn())[1]

            out = together([later(snapshot, delays[0])]
                           + [later(fork, d) for d in delays[1:-1]]
                           + [later(snapshot, delays[-1])])
            kids = [k for group in out[1:-1] for k in group]
            bad_kids = 0
            for k in kids:
                try:
                    m, argv = state_of(k)
                    if m != marker or src.token not in argv:
                        bad_kids += 1
                        failures.append(f"fork round {r}: child {k.sandbox_id} has marker "
                                        f"{m!r} (want {marker!r}), holder {argv[:60]!r}")
                except SandlotError as e:
                    bad_kids += 1
                    failures.append(f"fork round {r}: child {k.sandbox_id}: {describe(e)}")
                calls.record("kill", k.kill)
            states = []
            for snap in snaps:
                state = snap.refresh().state
                states.append(state)
                if state == "ready":
                    expect[snap.snapshot_id] = (marker, src.token)
            try:
                m, argv = state_of(src.sbx)
                parent_ok = m == marker and src.token in argv
            except SandlotError as e:
                parent_ok = False
                failures.append(f"fork round {r}: the parent: {describe(e)}")
            rounds.append({"children": len(kids), "children_bad": bad_kids,
                           "snapshots": states, "parent_ok": parent_ok, **calls.to_dict()})
            failures += [f"fork round {r}: {u}" for u in calls.untyped]
            print(f"forks during a snapshot, round {r + 1}: {rounds[-1]}", flush=True)
        result["forks_during_snapshot"] = rounds

        # 3. A snapshot deleted while a restore from it runs.
        rounds = []
        base = src.sbx.create_snapshot().wait(timeout=300)
        t0 = time.monotonic()
        base.restore().kill()
        t_restore = time.monotonic() - t0
        base.remove()
        for r in range(args.rounds * 2):
            calls = Calls()
            marker = src.mark()
            snap = src.sbx.create_snapshot().wait(timeout=300)
            sid = snap.snapshot_id
            delay = rng.uniform(0, t_restore)

            def restore(sid=sid, calls=calls):
                return calls.record("restore", Snapshot.get(sid, **kw).restore)

            def delete(sid=sid, delay=delay, calls=calls):
                time.sleep(delay)
                return calls.record("delete", Snapshot.delete, sid, **kw)

            restored, deleted = together([restore, delete])
            row: dict = {"delete_after_s": round(delay, 3), "restored": restored is not None,
                         "deleted": bool(deleted)}
            if restored is not None:
                # The restored sandbox has the snapshot's state, and can be snapshotted and
                # forked (a deletion must not pull its files from under it).
                try:
                    m, _ = state_of(restored)
                    row["restored_marker_ok"] = m == marker
                    if m != marker:
                        failures.append(f"delete round {r}: restored marker {m!r}")
                except SandlotError as e:
                    failures.append(f"delete round {r}: restored sandbox: {describe(e)}")
                again = calls.record("snapshot of the restored",
                                     lambda s=restored: s.create_snapshot().wait(timeout=300))
                row["restored_snapshot_ok"] = again is not None
                if again is not None:
                    calls.record("delete", again.remove)
                kids = calls.record("fork of the restored", restored.fork, 1)
                row["restored_fork_ok"] = bool(kids) and not kids.errors
                for k in kids or []:
                    calls.record("kill", k.kill)
                if again is None or not row["restored_fork_ok"]:
                    failures.append(f"delete round {r}: the restored sandbox cannot be "
                                    f"snapshotted or forked: {calls.typed} {calls.untyped}")
                calls.record("kill", restored.kill)
            try:
                after = Snapshot.get(sid, **kw).state
            except NotFoundError:
                after = "not found"
            row["snapshot_after"] = after
            if deleted and after not in ("deleted", "not found"):
                failures.append(f"delete round {r}: deleted, but the snapshot is {after}")
            if not deleted:
                if after == "ready":
                    expect[sid] = (marker, src.token)
                else:
                    failures.append(f"delete round {r}: the delete failed and the snapshot is "
                                    f"{after}")
            row.update(calls.to_dict())
            failures += [f"delete round {r}: {u}" for u in calls.untyped]
            rounds.append(row)
            print(f"delete during restore, round {r + 1}: {row}", flush=True)
        result["delete_during_restore"] = rounds

        # 4. Nothing lost: every ready snapshot restores with its marker; nothing left over.
        ready = [s.snapshot_id for s in Snapshot.list(**kw) if s.state == "ready"]
        lost = []
        for sid in ready:
            try:
                sbx = Snapshot.get(sid, **kw).restore()
                m, argv = state_of(sbx)
                if sid in expect and (m, expect[sid][1] in argv) != (expect[sid][0], True):
                    lost.append(f"{sid}: marker {m!r}, want {expect[sid][0]!r}")
                sbx.kill()
            except SandlotError as e:
                lost.append(f"{sid}: {describe(e)}")
        failures += [f"final restore: {m}" for m in lost]
        src.sbx.kill()
        time.sleep(1)
        left = orphans(srv, kw)
        if left:
            failures.append(f"left over after every sandbox was killed: {left}")
        result["final"] = {"ready_snapshots": len(ready), "restore_failures": lost,
                           "orphans": left}
    finally:
        finish(srv, args.keep)
    fr, dr = result.get("forks_during_snapshot", []), result.get("delete_during_restore", [])
    result.update({"args": vars(args), "seconds": round(time.monotonic() - t_start),
                   "failures": failures, "server_log": str(srv.log_path)})

    def typed_total(rows):
        out: dict[str, int] = {}
        for row in rows:
            for k, v in row.get("typed_errors", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    result["summary"] = {
        "creates at once (ok / n), wall s": (result.get("creates", {}).get("created"),
                                             args.creates,
                                             result.get("creates", {}).get("wall_s")),
        "creates typed errors": result.get("creates", {}).get("typed_errors"),
        "forks during snapshot: children ok / made": (
            sum(r["children"] - r["children_bad"] for r in fr), sum(r["children"] for r in fr)),
        "forks during snapshot: snapshots": [s for r in fr for s in r["snapshots"]],
        "forks during snapshot: typed errors": typed_total(fr),
        "delete during restore: restored / deleted / both / rounds": (
            sum(r["restored"] for r in dr), sum(r["deleted"] for r in dr),
            sum(r["restored"] and r["deleted"] for r in dr), len(dr)),
        "delete during restore: typed errors": typed_total(dr),
        "untyped errors": sum("untyped" in f or "SandlotError:" in f for f in failures),
        "ready snapshots restored at the end": (
            len(result.get("final", {}).get("restore_failures", []) or []) == 0,
            result.get("final", {}).get("ready_snapshots")),
        "seconds": result["seconds"], "failures": len(failures)}
    return result
