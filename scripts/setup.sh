#!/usr/bin/env bash
# Idempotent setup: Debian packages, the virtualenv, Node and the TypeScript packages, and the
# base template. Run as root on Debian 12. A second run installs nothing and rebuilds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  qemu-system-x86 qemu-utils mmdebstrap busybox-static e2fsprogs cpio util-linux zstd
  nftables iproute2 dnsmasq-base runsc ca-certificates python3 python3-venv python3-pip curl
  postgresql  # a deployment's shared metadata: the tests start their own server from it
  skopeo umoci buildah kmod  # sandboxes from OCI images and Dockerfiles (docs/images.md)
  docker-registry musl-tools  # the image tests: a loopback registry, a musl-linked image
  golang-go  # builds the guest agent and init (static, standard library only) for templates
  gcc libc6-dev  # builds the library QEMU preloads (vmm/qemu_preload.c)
  fuse3  # lazy restore: an image this host lacks is mounted from the store (runtime/lazy.py)
  chromium  # tests/console: the console in a real headless browser (Playwright drives it)
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

# Node from Debian's own packages (not another vendor's build that may already be on PATH), and
# the TypeScript packages' dev dependencies from their lockfiles; stamped by the lockfiles' hash.
debian_node() {
  dpkg-query -W -f='${db:Status-Status} ${Maintainer}\n' nodejs npm 2>/dev/null |
    awk '$1 == "installed" && /[Dd]ebian/ {n++} END {exit n != 2}'
}
if ! debian_node; then
  echo "setup: installing Debian's nodejs and npm"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Name Debian's version: another vendor's newer nodejs would otherwise stay.
  node_version=$(apt-cache show nodejs | awk '/^Version:/ {v = $2} /^Maintainer:.*[Dd]ebian/ {print v; exit}')
  apt-get install -y -qq --allow-downgrades "nodejs=$node_version" npm >/dev/null
fi
stamp=".stamps/npm-$(cat sdk-ts/package-lock.json tests/ts/e2b-js/package-lock.json | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ ! -d sdk-ts/node_modules ] || [ ! -d tests/ts/e2b-js/node_modules ]; then
  (cd sdk-ts && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build >/dev/null)
  (cd tests/ts/e2b-js && npm ci --no-audit --no-fund --loglevel=error)
  rm -f .stamps/npm-*; touch "$stamp"
fi
# The web console (console/, served at /console): built into console/dist from its lockfile,
# stamped by its lockfile and sources.
stamp=".stamps/console-$(cat console/package-lock.json console/tsconfig.json console/build.mjs console/src/* | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ ! -f console/dist/index.html ]; then
  (cd console && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build)
  rm -f .stamps/console-*; touch "$stamp"
fi

# Content-hash cached: returns at once when the base template is up to date. It builds the
# guest agent and init from src/sandlot/guest/go first (cached by their sources' hash).
.venv/bin/sandlot template build base
# The OCI images the image tests push to their loopback registry (built once, kept by recipe).
.venv/bin/python tests/imagekit.py >/dev/null
