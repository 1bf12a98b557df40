"""Repeated-fork debugging: keep the sandbox alive at the point of interest and fork it again
for every investigation, even destructive ones; the original stays at the buggy state.

Seed scenario: "Fork" (debugging).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys

from sandlot import Sandbox

# A service with a leak: it keeps every request in memory. SIGUSR1 dumps its state and exits
# (a destructive probe, like attaching a debugger that kills the process).
SERVICE = """
import json, os, signal, time
requests = []
def dump(*_):
    json.dump({"pid": os.getpid(), "kept": len(requests)}, open("/tmp/dump.json", "w"))
    os._exit(0)
signal.signal(signal.SIGUSR1, dump)
open("/tmp/service.pid", "w").write(str(os.getpid()))
while True:
    requests.append(bytearray(4096))
    if len(requests) == 500:
        break
signal.pause()
"""

INVESTIGATIONS = [
    "cat /proc/$(cat /tmp/service.pid)/status | grep -E 'VmRSS|State'",
    "kill -USR1 $(cat /tmp/service.pid); sleep 1; cat /tmp/dump.json",
    "ls -l /proc/$(cat /tmp/service.pid)/fd | wc -l",
]


def main() -> int:
    sandbox = Sandbox.create(timeout=300)
    try:
        sandbox.files.write("/tmp/service.py", SERVICE)
        sandbox.commands.start("python3 /tmp/service.py")
        sandbox.commands.run("while [ ! -s /tmp/service.pid ]; do sleep 0.1; done; sleep 1",
                             timeout=60, check=True)
        for i, probe in enumerate(INVESTIGATIONS):
            investigation = sandbox.fork()[0]
            try:
                logs = investigation.commands.run(probe, timeout=60)
            finally:
                investigation.kill()
            print(f"investigation {i}: {logs.stdout.strip()}")
            if not logs.ok:
                return 1
        # The destructive dump ran in a fork: the original service still runs, leak intact.
        alive = sandbox.commands.run("kill -0 $(cat /tmp/service.pid) && echo alive; "
                                     "ls /tmp/dump.json 2>/dev/null || echo no-dump").stdout
        print(f"original: {alive.split()}")
        return 0 if alive.split() == ["alive", "no-dump"] else 1
    finally:
        sandbox.kill()


if __name__ == "__main__":
    sys.exit(main())
