#!/bin/sh
# description: benchmark: the create-to-running time a device adds through tenantvmd: the
#   same tenant (the test guest) created without a GPU and with QEMU's edu as a whole card
#   (the gpu-tenant scenario's SIMULATED host at edu's address, --gpu-sysfs-root /), 3
#   rounds each, alternately, each on a fresh daemon; medians and their ratio as NOTE lines
# limit: 600
# sets: bench
. "$NH_LIB"
need_kvm
need_edu
need_tenant_cgroups
unbind_vfio "$edu"
trap 'unbind_vfio "$edu"' EXIT
run_or_fail "$NH_BIN/nh-gpu-tenant" bench "$edu" "${NH_GPU_ROUNDS:-3}"
