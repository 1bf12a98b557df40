"""sandlot benchmark: starts its own sandlot server, drives it through the public SDK, measures
cold boot, create, exec, files, snapshot pause/ready, restore, fork and memory, and gVisor (the
peer) in the same run. Prints a table (p50/p90 over repeated runs, ratios to the cold-boot
baseline and the peer) and writes JSON.

    python bench/run.py [--quick | --smoke] [--json PATH] [--runs N]

See docs/benchmarks.md for what each figure means and how it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from _peer import run_peer  # noqa: E402
from _plan import make_plan  # noqa: E402
from _report import REQUIRED, build_json, markdown, render  # noqa: E402
from _server import IMAGES_DIR, BenchServer, qemu_pids  # noqa: E402
from _steps import STEPS, Ctx, Results  # noqa: E402
from _steps_fs import step_filesystem  # noqa: E402
from _steps_store import step_incremental, step_store_restore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_FORK = [name for name, _ in STEPS].index("fork")
ALL_STEPS = [*STEPS[:_FORK], ("incremental snapshots", step_incremental),
             ("filesystem-only snapshots", step_filesystem), *STEPS[_FORK:],
             ("restore from S3, empty cache", step_store_restore)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer repetitions (< 5 minutes)")
    mode.add_argument("--smoke", action="store_true",
                      help="each figure once with tiny counts (fork 2, 2 idle, 16 MB files), "
                           "no peer: only checks that the benchmark runs")
    p.add_argument("--json", type=Path, help="write the figures to this JSON file")
    p.add_argument("--runs", type=int, help="repetitions of each repeated figure")
    p.add_argument("--no-peer", action="store_true", help="skip gVisor")
    p.add_argument("--steps", metavar="WORDS",
                   help="only the steps whose name holds one of these comma-separated words "
                        "(e.g. 'snapshot,fork'); figures of the others stay out of the table")
    p.add_argument("--no-network", action="store_true",
                   help="run the server with SANDLOT_NETWORK=off (QEMU user networking)")
    p.add_argument("--workdir", type=Path,
                   help="where the server keeps its data (default: a new dir in /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work dir afterwards")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="measure nothing: print the table of a saved JSON report")
    p.add_argument("--markdown", action="store_true", help="with --render: as markdown")
    return p.parse_args(argv)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def other_qemus(mine: Path) -> int:
    """QEMU processes on the machine that this run did not start (a shared machine)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("qemu-system") or "/qemu-system" in cmd.split(" ")[0]:
            if f"{mine}/" not in cmd:
                count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        if args.markdown:
            print(markdown(report), end="")
        else:
            render(report, Console() if sys.stdout.isatty() else Console(width=190))
        return 0
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    plan = make_plan(mode, args.runs)
    if args.no_peer:
        plan = plan.__class__(**{**plan.__dict__, "peer": False})
    console = Console() if sys.stdout.isatty() else Console(width=190)
    if not (IMAGES_DIR / "templates" / "base.json").exists():
        console.print(f"[red]no base template under {IMAGES_DIR}: run `make setup`[/]")
        return 2
    if args.no_network:
        os.environ["SANDLOT_NETWORK"] = "off"
    root = args.workdir or Path(f"/var/tmp/sandlot-bench-{os.getpid()}")
    server = BenchServer.make(root)
    from sandlot.vmm.accel import detect_accel

    accel = detect_accel()
    started = datetime.now(UTC)
    t0 = time.monotonic()
    run = {"started_at": started.isoformat(timespec="seconds"), "mode": mode,
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "git": git_commit(), "load_before": [round(x, 2) for x in os.getloadavg()],
           "other_qemu_before": other_qemus(server.run_root),
           "network": os.environ.get("SANDLOT_NETWORK", "on")}
    results = Results()
    peer: dict = {"unavailable": "skipped (--no-peer)" if args.no_peer else "skipped (smoke run)"}
    console.print(f"[bold]sandlot bench[/] {mode}: {plan.runs} runs, accel {accel}, work dir "
                  f"{root}, load {run['load_before']}, {run['other_qemu_before']} other QEMU "
                  "processes running")
    ok = False
    try:
        server.start()
        ctx = Ctx(server=server, plan=plan, results=results, console=console)
        for name, step in ALL_STEPS:
            if name.startswith("snapshot of a bigger") and not plan.big_memory_mb:
                continue
            if args.steps and not any(w.strip() and w.strip() in name
                                      for w in args.steps.split(",")):
                continue
            ts = time.monotonic()
            ctx.log(f"[bold]{name}[/]")
            try:
                step(ctx)
            except Exception as e:  # noqa: BLE001 - report it, measure the rest
                results.errors[name] = f"{type(e).__name__}: {e}"
                console.print(f"[red]{name} failed:[/] {traceback.format_exc()}")
            results.values.setdefault("step_s", {})[name] = round(time.monotonic() - ts, 1)
        run["load_after_sandlot"] = [round(x, 2) for x in os.getloadavg()]
        if plan.peer:
            ts = time.monotonic()
            ctx.log("[bold]peer: gVisor[/]")
            peer = run_peer(plan.peer_runs, root / "peer")
            results.values.setdefault("step_s", {})["peer"] = round(time.monotonic() - ts, 1)
        ok = not results.errors
    finally:
        server.close()
        leftover = qemu_pids(server.run_root)
        if leftover:
            results.notes.append(f"QEMU processes left behind and killed: {leftover}")
        if (ok and not args.keep) or args.workdir is None and ok:
            shutil.rmtree(root, ignore_errors=True)
        elif root.exists():
            console.print(f"work dir kept: {root} (server log: {server.log_path})")
    run["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    run["duration_s"] = round(time.monotonic() - t0, 1)
    run["load_after"] = [round(x, 2) for x in os.getloadavg()]
    run["other_qemu_after"] = other_qemus(server.run_root)
    if run["other_qemu_before"] or run["other_qemu_after"]:
        results.notes.append("the machine was shared: other QEMU processes were running "
                             f"({run['other_qemu_before']} at start, {run['other_qemu_after']} "
                             "at the end)")
    report = build_json(results, plan, peer, accel, run)
    missing = [k for k in REQUIRED if k not in report]
    assert not missing, missing
    render(report, console)
    console.print(f"{mode} run took {run['duration_s']:.0f} s; load average "
                  f"{run['load_before']} -> {run['load_after']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
