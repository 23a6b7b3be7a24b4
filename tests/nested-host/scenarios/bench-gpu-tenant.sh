#!/bin/sh
# description: benchmark: the create-to-running time a device adds through tenantvmd: the
#   same tenant (the test guest) created without a GPU and with QEMU's edu as a whole card
#   (the gpu-tenant scenario's SIMULATED host at edu's address, --gpu-sysfs-root /), 3
#   rounds each, alternately, each on a fresh daemon; medians and their ratio as NOTE lines
# limit: 600
# sets: bench
. "$NH_LIB"
need_kvm
edu="$(pci_devices 1234 11e8 | sed -n 1p)"
[ -n "$edu" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$(iommu_group "$edu")" ] || skip "no IOMMU (intel_iommu=on) for $edu"
need_modules vfio_pci vfio_iommu_type1
if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "cannot mount cgroup2"
fi
for c in cpu memory pids io; do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || step "controller $c not enabled"
done
unbind_vfio "$edu"
trap 'unbind_vfio "$edu"' EXIT
run_or_fail "$NH_BIN/nh-gpu-tenant" bench "$edu" "${NH_GPU_ROUNDS:-3}"
