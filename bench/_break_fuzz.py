"""`break.py fuzz`: schemathesis against the server's own `/openapi.json`, in three passes, with
the `not_a_server_error` check, one worker, and a per-request timeout (a request that runs
past it counts as a hang):

- edge: every operation that starts no VM, with generated ids (mostly 404, 400, 422, 405);
- sandbox: the operations on one live sandbox and one ready snapshot (their ids fixed), i.e.
  commands, files, ports, network, snapshot create/get/rename/wait; the calls that would end
  that sandbox (kill, pause, timeout) and snapshot deletion are left to the third pass;
- vm: the operations that start or end VMs (create, fork, rollback, pause, resume, restore,
  timeout, kill), fuzzing phase only, few examples, rate-limited; a reaper kills every other
  sandbox as it appears, so a generated create cannot pile VMs up.

The E2B routes under /e2b are not in the OpenAPI document (tests/e2b drives them). Every
request and response is in schemathesis's HAR report; 5xx answers are listed with their
request."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _break import describe, finish, make_server, orphans
from sandlot import Sandbox, SandlotError

VM_OPS = [  # (method, path regex) of the operations that start or end a VM
    ("POST", "^/v1/sandboxes$"), ("POST", "/fork$"), ("POST", "/rollback$"),
    ("POST", "/pause$"), ("POST", "/resume$"), ("POST", "/restore$"),
    ("POST", "/v1/sandboxes/{sandbox_id}/timeout$"), ("DELETE", "^/v1/sandboxes/{sandbox_id}$"),
]
ST = Path(sys.executable).with_name("schemathesis")
GUEST_PATHS = ["/tmp", "/tmp/fuzz", "/tmp/fuzz/a.txt", "/tmp/fuzz/dir/b", "/tmp/with space",
               "/tmp/\u00fcn\u00efc\u00f8d\u00e9", "/tmp/fuzz/" + "x" * 255,
               "/tmp/fuzz/" + "y" * 300, "/tmp/fuzz/../fuzz/c", "/etc/hostname",
               "/proc/self/status", "/nonexistent/x", "/root", "/tmp/fuzz/a.txt/under-a-file"]


def op_ids(url: str, key: str) -> dict[str, list[str]]:
    """operationIds of the schema, split into VM operations, the sandbox pass's and the rest."""
    import re

    import httpx

    schema = httpx.get(f"{url}/openapi.json", timeout=30).json()
    vm, on_sandbox, rest = [], [], []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            oid = op["operationId"]
            if any(method.upper() == m and re.search(rx.replace("{", r"\{").replace("}", r"\}"),
                                                     path) for m, rx in VM_OPS):
                vm.append(oid)
            else:
                rest.append(oid)
                if ("{sandbox_id}" in path or "{id_or_name}" in path) and not (
                        method == "delete" and path == "/v1/snapshots/{id_or_name}"):
                    on_sandbox.append(oid)
    return {"vm": vm, "sandbox": on_sandbox, "edge": rest}


def schemathesis(url: str, key: str, out: Path, include: list[str], *, examples: int,
                 timeout: float, seed: int, params: dict[str, str] | None = None,
                 phases: str | None = None, rate: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(ST)]
    if params:
        # Fixed ids; guest paths drawn from GUEST_PATHS most of the time (the API's path rule,
        # absolute, is not in the schema: generated paths alone stop at validation).
        cfg = out / "schemathesis.toml"
        cfg.write_text(
            "[dictionaries.guest_paths]\nvalues = " + json.dumps(GUEST_PATHS) + "\n\n"
            "[parameters]\n" + "".join(f'"{k}" = "{v}"\n' for k, v in params.items())
            + "".join(f'"{k}" = {{ dictionary = "guest_paths", probability = 0.7 }}\n'
                      for k in ("query.path", "body.path", "body.src", "body.dst")))
        cmd += ["--config-file", str(cfg)]
    cmd += ["run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {key}",
            "-c", "not_a_server_error", "-n", str(examples), "--request-timeout", str(timeout),
            "--seed", str(seed), "-w", "1", "--no-color", "--generation-database", "none",
            "--report", "har,ndjson",
            "--report-har-path", str(out / "har.json"),
            "--report-ndjson-path", str(out / "events.ndjson")]
    for oid in include:
        cmd += ["--include-operation-id", oid]
    if phases:
        cmd += ["--phases", phases]
    if rate:
        cmd += ["--rate-limit", rate]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)  # its caches go there
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    shown = " ".join(c if " " not in c else repr(c) for c in cmd).replace(key, "$KEY")
    return {"command": shown, "exit": proc.returncode, "seconds": round(time.monotonic() - t0),
            **tally(out)}


def tally(out: Path) -> dict:
    """Requests, status codes, 5xx answers with their requests, and errors (timeouts) from the
    HAR and NDJSON reports."""
    entries = json.loads((out / "har.json").read_text())["log"]["entries"] \
        if (out / "har.json").exists() else []
    statuses = collections.Counter(e["response"]["status"] for e in entries)
    server_errors = []
    for e in entries:
        if e["response"]["status"] >= 500:
            req = e["request"]
            server_errors.append({
                "status": e["response"]["status"], "method": req["method"], "url": req["url"],
                "body": (req.get("postData") or {}).get("text", "")[:500],
                "response": (e["response"].get("content") or {}).get("text", "")[:500]})
    slow = sorted(((e["time"], e["request"]["method"], e["request"]["url"]) for e in entries),
                  reverse=True)[:5]
    scenarios = collections.Counter()
    errors = []
    if (out / "events.ndjson").exists():
        for line in open(out / "events.ndjson"):
            event = json.loads(line)
            done = event.get("ScenarioFinished") if isinstance(event, dict) else None
            if done:
                scenarios[done["status"]] += 1
                if done["status"] == "error":
                    errors.append(json.dumps(done)[:600])
    hangs = [e for e in errors if "timed out" in e.lower() or "timeout" in e.lower()]
    return {"requests": len(entries), "status_codes": dict(sorted(statuses.items())),
            "responses_500": statuses.get(500, 0),
            "responses_5xx": sum(v for k, v in statuses.items() if k >= 500),
            "server_errors": server_errors, "scenarios": dict(scenarios),
            "errors": errors[:20], "hangs": len(hangs),
            "slowest_ms": [(round(t), m, u[:120]) for t, m, u in slow]}


class Reaper(threading.Thread):
    """Kills every sandbox but `keep` as soon as it is listed."""

    def __init__(self, kw: dict, keep: set[str]) -> None:
        super().__init__(daemon=True)
        self.kw, self.keep = kw, keep
        self.killed: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                for s in Sandbox.list(**self.kw):
                    if s.sandbox_id not in self.keep | self.killed:
                        Sandbox.connect(s.sandbox_id, **self.kw).kill()
                        self.killed.add(s.sandbox_id)
            except SandlotError:
                pass


def run(args) -> dict:
    if not ST.exists():
        raise SystemExit(f"no {ST}: pip install schemathesis (the `test` extra)")
    root = Path(tempfile.mkdtemp(prefix="sandlot-break-fuzz-"))
    srv = make_server(root, "z")
    srv.start()
    kw = srv.client_kwargs()
    t_start = time.monotonic()
    failures: list[str] = []
    passes: dict[str, dict] = {}
    try:
        groups = op_ids(srv.url, srv.key)
        common = dict(timeout=args.request_timeout, seed=args.seed)
        passes["edge"] = schemathesis(srv.url, srv.key, root / "edge", groups["edge"],
                                      examples=args.max_examples, **common)
        print(f"edge: {summary_of(passes['edge'])}", flush=True)

        sbx = Sandbox.create(**kw, timeout=3600)
        snap = sbx.create_snapshot(name="fuzzed").wait(timeout=300)
        params = {"path.sandbox_id": sbx.sandbox_id, "path.id_or_name": snap.snapshot_id}
        passes["sandbox"] = schemathesis(srv.url, srv.key, root / "sandbox", groups["sandbox"],
                                         examples=args.max_examples, params=params, **common)
        print(f"sandbox: {summary_of(passes['sandbox'])}", flush=True)
        alive = sbx.is_running()
        passes["sandbox"]["sandbox_alive_after"] = alive

        reaper = Reaper(kw, {sbx.sandbox_id})
        reaper.start()
        passes["vm"] = schemathesis(srv.url, srv.key, root / "vm", groups["vm"],
                                    examples=args.vm_examples, params=params,
                                    phases="fuzzing", rate="30/m", **common)
        reaper.done.set()
        reaper.join(30)
        passes["vm"]["reaped"] = len(reaper.killed)
        print(f"vm: {summary_of(passes['vm'])}", flush=True)
        for s in Sandbox.list(**kw):
            Sandbox.connect(s.sandbox_id, **kw).kill()
        time.sleep(1)
        left = orphans(srv, kw)
        alive_health = srv.proc is not None and srv.proc.poll() is None
    except SandlotError as e:
        failures.append(f"the loop itself: {describe(e)}")
        left, alive_health = {}, False
    finally:
        finish(srv, args.keep)
    for name, p in passes.items():
        if p["responses_500"]:
            failures.append(f"{name}: {p['responses_500']} responses 500: "
                            f"{p['server_errors'][:3]}")
        if p["hangs"]:
            failures.append(f"{name}: {p['hangs']} requests past {args.request_timeout} s")
    if left:
        failures.append(f"left over after every sandbox was killed: {left}")
    if not alive_health:
        failures.append("the server did not survive the fuzzing")
    result = {"args": vars(args), "seconds": round(time.monotonic() - t_start),
              "passes": passes, "orphans": left, "failures": failures,
              "work_dir": str(root), "server_log": str(srv.log_path)}
    result["summary"] = {name: summary_of(p) for name, p in passes.items()}
    result["summary"].update({"seconds": result["seconds"], "failures": len(failures)})
    return result


def summary_of(p: dict) -> dict:
    return {"operations": p["command"].count("--include-operation-id"),
            "requests": p["requests"], "5xx": p["responses_5xx"], "500": p["responses_500"],
            "hangs": p["hangs"], "errors": p["scenarios"].get("error", 0),
            "status codes": p["status_codes"], "slowest ms": p["slowest_ms"][:1],
            "seconds": p["seconds"]}
