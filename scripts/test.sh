#!/usr/bin/env bash
# `make test`: three pytest runs side by side, since one run of the VM tests alone keeps the
# host's 2 CPUs only ~66% busy (it waits on guests, servers and sockets in between):
#   - the fast tier (tests/unit: in process, on the fake runtime, no VM);
#   - "apis": the E2B, TypeScript, console, framework and S3 tests, test_store_s3 and
#     test_cluster (the two runs took 27 and 23 minutes with test_cluster_* here too);
#   - "vm": the rest of tests/vm, whose output is shown as it runs.
# Each pytest run has session fixtures of its own (server, S3, PostgreSQL, registry) and names
# its own host-wide objects (nft table, namespaces, run dirs: tests/harness.py), so the runs
# cannot collide. The other two reports are printed after the vm run's. Exit status: 0 if all
# three passed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
moved=(tests/vm/test_store_s3.py tests/vm/test_cluster.py)
apis=(tests/e2b tests/ts tests/console tests/integrations tests/storage "${moved[@]}")
not_apis=()
for f in "${moved[@]}"; do not_apis+=("--ignore=$f"); done

unit_log=$(mktemp /tmp/sandlot-unit-XXXXXX.log)
apis_log=$(mktemp /tmp/sandlot-apis-XXXXXX.log)
"$py" -m pytest tests/unit -q -ra --durations=10 >"$unit_log" 2>&1 &
unit=$!
"$py" -m pytest "${apis[@]}" -q -ra --durations=20 >"$apis_log" 2>&1 &
apis_pid=$!
# A cancelled run (Ctrl-C, SIGTERM) ends all three.
trap 'kill -TERM "$unit" "$apis_pid" 2>/dev/null; wait "$unit" "$apis_pid"; rm -f "$unit_log" "$apis_log"; exit 130' INT TERM
"$py" -m pytest tests/vm "${not_apis[@]}" -q -ra --durations=30
vm=$?
wait "$apis_pid"
apis_rc=$?
wait "$unit"
fast=$?
trap - INT TERM
for part in "apis:$apis_log" "fast tier (tests/unit):$unit_log"; do
  echo
  echo "==================== ${part%%:*}, run beside the vm tests ===================="
  cat "${part#*:}"
done
rm -f "$unit_log" "$apis_log"
echo "make test: tests/unit exited $fast, apis $apis_rc, vm $vm"
(( fast == 0 && apis_rc == 0 && vm == 0 ))
