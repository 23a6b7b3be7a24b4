#!/bin/sh
# description: the whole lifecycle of an inference tenant on the default backend, through
#   tenantvmd inside the outer guest: tenantvm create (guest image, tenantvm-vmm, agent over
#   vsock), a key from tenantvm key create, completions through the TLS front door (plain
#   and streamed), a model trained on another corpus pushed with tenantvm model push and
#   served by name (its completions differ from the default model's), the host image scanned
#   for the pushed model's marker (none; a plaintext copy as positive control), stop, start,
#   both models again, destroy with its receipt checked
# limit: 600
# sets: ci
. "$NH_LIB"
need_kvm
need_modules vhost_vsock dm_crypt loop
# tenantvmd puts each tenant in a cgroup of its own (memory, cpu, pids).
need_tenant_cgroups
# The front door listens on 127.0.0.1: the outer guest's init leaves loopback down.
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up || fail "cannot bring up loopback"
run_or_fail "$NH_BIN/nh-inference-tenant"
