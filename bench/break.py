"""Loops that try to break sandlot (issue #16, item 5), each bounded and against a server of its
own (`sandlot.testing.ServerProcess`: own data dir, instance, key; no warm pool):

    .venv/bin/python bench/break.py crash [--iterations 20] [--s3]
    .venv/bin/python bench/break.py concurrency [--creates 10] [--rounds 3]
    .venv/bin/python bench/break.py abuse [--phase-seconds 20]
    .venv/bin/python bench/break.py fuzz [--max-examples 20]
    .venv/bin/python bench/break.py all

Each prints a summary and writes JSON to bench/results/break-<loop>.json (or --json PATH).
The exit status is 1 when a loop saw something it must not (docs/security.md, "Tests that try
to break it", says what each checks and lists the figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _break import server_exceptions, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="loop", required=True)

    crash = sub.add_parser("crash", help="SIGKILL the server mid-snapshot/upload/fork/restore")
    crash.add_argument("--iterations", type=int, default=20)
    crash.add_argument("--fork", type=int, default=2, help="children per fork")
    crash.add_argument("--seed", type=int, default=16)
    crash.add_argument("--s3", action="store_true", help="the store on S3 (SeaweedFS)")
    crash.add_argument("--calibrate", type=int, default=2,
                       help="uninterrupted runs of each step that time it first")

    conc = sub.add_parser("concurrency", help="creates at once, forks during a snapshot, "
                          "a snapshot deleted while it is restored")
    conc.add_argument("--creates", type=int, default=10, help="creates at once")
    conc.add_argument("--rounds", type=int, default=3,
                      help="rounds of forks-during-snapshot and delete-during-restore")
    conc.add_argument("--forks", type=int, default=3, help="fork calls during each snapshot")
    conc.add_argument("--seed", type=int, default=16)

    abuse = sub.add_parser("abuse", help="a hostile guest beside a quiet one")
    abuse.add_argument("--phase-seconds", type=float, default=20,
                       help="how long each abuse runs (the fork bomb's `timeout`)")
    abuse.add_argument("--memory-mb", type=int, default=512, help="the abusive sandbox's RAM")

    fuzz = sub.add_parser("fuzz", help="schemathesis against /openapi.json")
    fuzz.add_argument("--max-examples", type=int, default=20,
                      help="cases per operation (operations that start VMs: --vm-examples)")
    fuzz.add_argument("--vm-examples", type=int, default=5,
                      help="cases per operation that starts a VM (create, fork, restore...)")
    fuzz.add_argument("--request-timeout", type=float, default=60)
    fuzz.add_argument("--seed", type=int, default=16)

    sub.add_parser("all", help="each loop once with its default bounds")
    for sp in (crash, conc, abuse, fuzz):
        sp.add_argument("--json", help="where to write the result (default "
                        "bench/results/break-<loop>.json)")
        sp.add_argument("--keep", action="store_true",
                        help="keep the server's data dir (disks, store) after the run")
    args = p.parse_args(argv)

    every = args.loop == "all"
    loops = ["crash", "concurrency", "abuse", "fuzz"] if every else [args.loop]
    bad = 0
    for loop in loops:
        if every:
            args = p.parse_args([loop])
        result = run(loop, args)
        if result.get("server_log"):
            errors = server_exceptions(Path(result["server_log"]))
            result["server_exceptions"] = errors
            if errors:
                result["failures"].append(f"{len(errors)} unhandled exceptions in the server's "
                                          f"log: {sorted(set(errors))[:5]}")
            result.setdefault("summary", {})["unhandled server exceptions"] = len(errors)
        path = write_result(loop, result, getattr(args, "json", None))
        summary = result.get("summary", {})
        print(f"\n== {loop}: {json.dumps(summary, indent=1, default=str)}")
        print(f"failures: {len(result['failures'])}")
        for f in result["failures"][:30]:
            print(f"  - {f}")
        print(f"JSON: {path}")
        bad += bool(result["failures"])
    return 1 if bad else 0


def run(loop: str, args) -> dict:
    if loop == "crash":
        import _break_crash as mod
    elif loop == "concurrency":
        import _break_concurrency as mod
    elif loop == "abuse":
        import _break_abuse as mod
    else:
        import _break_fuzz as mod
    return mod.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
