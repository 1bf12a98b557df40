#!/usr/bin/env bash
# `make test`: the fast tier (tests/unit: in process, on the fake runtime, no VM) runs beside
# the rest (real VMs, servers, the TypeScript SDK), whose run keeps the host's 2 CPUs ~62%
# busy; the fast tier's report is printed after the rest's. Each pytest run names its own
# host-wide objects (nft table, namespaces, run dirs: tests/harness.py), so the two cannot
# collide. Exit status: 0 if both passed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
log=$(mktemp /tmp/sandlot-unit-XXXXXX.log)
"$py" -m pytest tests/unit -q -ra --durations=10 >"$log" 2>&1 &
unit=$!
# A cancelled run (Ctrl-C, SIGTERM) ends both.
trap 'kill -TERM "$unit" 2>/dev/null; wait "$unit"; rm -f "$log"; exit 130' INT TERM
"$py" -m pytest tests --ignore=tests/unit -q -ra --durations=30
rest=$?
wait "$unit"
fast=$?
trap - INT TERM
echo
echo "==================== the fast tier (tests/unit), run beside the rest ===================="
cat "$log"
rm -f "$log"
echo "make test: tests/unit exited $fast, the rest $rest"
(( fast == 0 && rest == 0 ))
