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
need_tenant_cgroups
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up || fail "cannot bring up loopback"
export NH_BACKEND=qemu-kvm
run_or_fail "$NH_BIN/nh-inference-tenant"
