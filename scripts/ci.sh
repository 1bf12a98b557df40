#!/usr/bin/env bash
# `make ci`: CI on this host. The current HEAD is cloned into a new temporary directory and
# `.ci/run` runs there as CI runs it (CI=true); then nothing the run started may still run
# (scripts/leftovers.py: servers, QEMUs, S3, PostgreSQL, registries, namespaces, nft objects).
# Exit status: the run's, or 1 if it passed but left something. KEEP=1 keeps the clone.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
head=$(git rev-parse HEAD)
work=$(mktemp -d /tmp/sandlot-ci-XXXXXX)
tag=$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \n')
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT

python3 scripts/leftovers.py snapshot "$work/host-before.json"
# A worktree's clone would check out the repository's default branch: check out HEAD itself.
git clone -q --no-checkout "$root" "$work/sandlot" && git -C "$work/sandlot" checkout -q "$head" \
  || { echo "ci: cannot clone $root at $head"; exit 1; }
echo "ci: $(git log -1 --format='%h %s' "$head") in $work/sandlot"
start=$(date +%s)
cpu_before=$(head -1 /proc/stat)
(cd "$work/sandlot" && SANDLOT_CI_RUN=$tag CI=true bash .ci/run)
rc=$?
echo "ci: .ci/run exited $rc after $(( $(date +%s) - start )) s"
# How busy the host's CPUs were meanwhile (all of them, whatever ran): what running more of the
# suite at once could gain.
python3 - "$cpu_before" "$(head -1 /proc/stat)" <<'PY'
import os, sys
a, b = ([int(x) for x in line.split()[1:]] for line in sys.argv[1:3])
d = [y - x for x, y in zip(a, b)]
idle = d[3] + d[4]  # idle, iowait
print(f"ci: the host's {os.cpu_count()} CPUs were busy {100 * (sum(d) - idle) / max(1, sum(d)):.0f}% "
      f"of the run (iowait {100 * d[4] / max(1, sum(d)):.0f}%)")
PY
python3 scripts/leftovers.py check "$work/host-before.json" "$tag" "$work" || { ((rc)) || rc=1; }
exit $rc
