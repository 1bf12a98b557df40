"""An E2B volume against the guest's own disk, side by side in one sandbox (docs/benchmarks.md,
"Volumes against the guest's disk"). One server of the benchmark's own (warm pool off), one
volume mounted at /mnt/vol through the unmodified e2b SDK; per run, in each of the volume and a
directory on the guest's disk, timed by the guest's clock inside one command:

- a sequential write of `--mib` MiB (`dd ... conv=fsync`), then the page cache dropped and the
  file read back (`dd` to /dev/null), in MB/s;
- `--files` small files (4 KiB each) written by the shell's own `echo` (no process each),
  then listed with their sizes (`ls -l`) and read (`cat`) after the cache is dropped, in
  files/s.

    .venv/bin/python bench/volumes.py [--runs 3] [--mib 64] [--files 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2b import Sandbox, Volume  # noqa: E402

from _server import BenchServer  # noqa: E402

MOUNT = "/mnt/vol"
DISK = "/root/bench-disk"
DROP = "sync; echo 3 > /proc/sys/vm/drop_caches"


def timed(box: Sandbox, script: str) -> float:
    """Seconds `script` took by the guest's clock (run as root, in one command)."""
    out = box.commands.run(f"s=$(date +%s%N); {script}; e=$(date +%s%N); echo $((e - s))",
                           user="root", timeout=600).stdout
    return int(out.split()[-1]) / 1e9


def measure(box: Sandbox, where: str, mib: int, files: int, run: int) -> dict[str, float]:
    d = f"{where}/r{run}"
    box.commands.run(f"mkdir -p {d}/small", user="root")
    write = timed(box, f"dd if=/dev/urandom of={d}/big bs=1M count={mib} conv=fsync "
                       "status=none")
    box.commands.run(DROP, user="root")
    read = timed(box, f"dd if={d}/big of=/dev/null bs=1M status=none")
    make = timed(box, f"x=$(head -c 3072 /dev/urandom | base64 -w0); for i in $(seq {files}); "
                      f"do echo \"$x\" > {d}/small/f$i; done; sync")  # the shell's own echo
    box.commands.run(DROP, user="root")
    scan = timed(box, f"ls -l {d}/small > /dev/null; cat {d}/small/* > /dev/null")
    box.commands.run(f"rm -rf {d}", user="root")
    mb = mib * (1 << 20) / 1e6
    return {"write_mb_s": mb / write, "read_mb_s": mb / read,
            "small_create_per_s": files / make, "small_list_read_per_s": files / scan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-vol-", dir="/var/tmp") as tmp:
        server = BenchServer.make(Path(tmp))
        server.extra_env["SANDLOT_POOL_SIZE"] = "0"
        server.start(timeout=120)
        kw = {"api_url": f"{server.url}/e2b", "sandbox_url": f"{server.url}/e2b/envd",
              "api_key": server.key}
        vol = Volume.create("bench", **kw)
        box = None
        try:
            box = Sandbox.create(volume_mounts={MOUNT: vol}, timeout=1800, **kw)
            box.commands.run(f"mkdir -p {DISK}", user="root")
            got: dict[str, dict[str, list[float]]] = {"volume": {}, "disk": {}}
            for run in range(args.runs):
                for side, where in (("volume", MOUNT), ("disk", DISK)):
                    for k, v in measure(box, where, args.mib, args.files, run).items():
                        got[side].setdefault(k, []).append(v)
                print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
        finally:
            if box is not None:
                box.kill()
            Volume.destroy(vol.volume_id, **kw)
            server.close()
    table = {side: {k: {"p50": statistics.median(v), "min": min(v), "max": max(v)}
                    for k, v in figures.items()} for side, figures in got.items()}
    print(f"| figure ({args.runs} runs, {args.mib} MiB, {args.files} x 4 KiB) | volume | "
          "guest disk | volume / disk |")
    print("|---|---:|---:|---:|")
    for k in table["volume"]:
        v, d = table["volume"][k]["p50"], table["disk"][k]["p50"]
        print(f"| {k} | {v:.1f} | {d:.1f} | {v / d:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "figures": table}, indent=2))


if __name__ == "__main__":
    main()
