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
(cd "$work/sandlot" && SANDLOT_CI_RUN=$tag CI=true bash .ci/run)
rc=$?
echo "ci: .ci/run exited $rc after $(( $(date +%s) - start )) s"
python3 scripts/leftovers.py check "$work/host-before.json" "$tag" "$work" || { ((rc)) || rc=1; }
exit $rc
