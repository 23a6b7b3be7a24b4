#!/bin/sh
# description: the inference-tenant scenario on QEMU under KVM with the agent over
#   vhost-vsock (tenantvmd --backend qemu-kvm --qemu-agent-transport vhost-vsock): create,
#   `tenantvm status` names the tenant's CID, completions through the TLS front door (plain
#   and streamed), a model push served by name, the host image scan, stop, start, destroy
# limit: 600
# needs: qemu
# sets: ci
. "$NH_LIB"
need_kvm
need_modules vhost_vsock dm_crypt loop
[ -c /dev/vhost-vsock ] || fail "no /dev/vhost-vsock after loading vhost_vsock"
if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "cannot mount cgroup2"
fi
for c in cpu memory pids io; do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || step "controller $c not enabled"
done
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up || fail "cannot bring up loopback"
export NH_BACKEND=qemu-kvm
run_or_fail "$NH_BIN/nh-inference-tenant"
