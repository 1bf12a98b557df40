#!/usr/bin/env bash
# Idempotent setup: Debian packages, the virtualenv, and the base template. Run as root on
# Debian 12. A second run installs nothing and rebuilds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  qemu-system-x86 qemu-utils mmdebstrap busybox-static e2fsprogs cpio util-linux zstd
  nftables iproute2 dnsmasq-base runsc ca-certificates python3 python3-venv python3-pip curl
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mkdir -p .stamps
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".stamps/pip-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  rm -f .stamps/pip-*; touch "$stamp"
fi

# Content-hash cached: returns at once when the base template is up to date.
.venv/bin/sandlot template build base
