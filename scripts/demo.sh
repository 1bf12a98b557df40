#!/usr/bin/env bash
# Start the server on 127.0.0.1:$1 (default 7070), run the snapshot/fork demo against it,
# then keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-7070}
export SANDLOT_URL="http://127.0.0.1:${PORT}"
export SANDLOT_API_KEY=${SANDLOT_API_KEY:-$(.venv/bin/sandlot keys create)}

SANDLOT_LOG=${SANDLOT_LOG:-WARNING} .venv/bin/sandlot serve --port "$PORT" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 100); do
  curl -fs "$SANDLOT_URL/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "demo: the server did not start" >&2; exit 1; }
  sleep 0.1
done

.venv/bin/python examples/demo.py

echo
echo "sandlot is serving on $SANDLOT_URL (API key: $SANDLOT_API_KEY). Ctrl-C to stop."
if [ -n "${SANDLOT_DEMO_EXIT:-}" ]; then exit 0; fi
wait $server || true
