#!/bin/sh
# Entry point of the sandlot host image: prepares /dev/kvm's group and cgroup v2 for the VMs,
# then runs its arguments (default: sandlot serve).
set -eu

# Each QEMU runs under a uid of its own with the `kvm` group (vmm/jail.py): that group must be
# the one that owns /dev/kvm on the node, whose number the image cannot know.
if [ -c /dev/kvm ]; then
  gid=$(stat -c %g /dev/kvm)
  if [ "$gid" != 0 ]; then
    if getent group kvm >/dev/null; then
      groupmod -o -g "$gid" kvm
    else
      groupadd -o -g "$gid" kvm
    fi
  fi
fi

# sandlot puts every QEMU in a cgroup of its own under /sys/fs/cgroup/sandlot/, which needs
# the memory, pids, cpu and io controllers enabled at /sys/fs/cgroup. In a container with its
# own cgroup namespace that is the container's cgroup, and cgroup v2 lets a cgroup that holds
# processes hand no controllers to its children: the container's processes move to a leaf,
# /sys/fs/cgroup/init, first (as docker-in-docker does). Only when this process is at the
# root of its own cgroup namespace, never in the node's hierarchy.
if [ -f /sys/fs/cgroup/cgroup.controllers ] && [ "$(cat /proc/self/cgroup)" = "0::/" ]; then
  mkdir -p /sys/fs/cgroup/init
  xargs -rn1 < /sys/fs/cgroup/cgroup.procs > /sys/fs/cgroup/init/cgroup.procs 2>/dev/null || :
  sed -e 's/ / +/g' -e 's/^/+/' < /sys/fs/cgroup/cgroup.controllers \
    > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null \
    || echo "sandlot-entrypoint: cannot enable the cgroup controllers; VMs may fail to" \
            "start (SANDLOT_CONFINE=off runs them unconfined)" >&2
fi

exec "$@"
