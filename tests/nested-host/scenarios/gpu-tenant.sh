#!/bin/sh
# description: a GPU tenant end to end through tenantvmd: a SIMULATED host file puts a
#   whole-only GPU at the PCI address of QEMU's edu (--gpu-sysfs-root /), tenantvm create
#   with gpu = { whole_gpu = true } binds edu's IOMMU group to vfio-pci (real sysfs),
#   tenantvm-vmm passes it through (real kernel VFIO) and the test guest reports edu's ids
#   (1234:11e8) and a DMA round trip; tenantvm destroy: no reset claimed (edu has none: the
#   receipt's device-reset fails saying so and quarantines the card), edu back on no
#   driver, scrub recorded as simulated, gpu-release shows the drivers; a SIGKILL of
#   tenantvmd between bind-gpu and attach-gpu, then a restart, converges with edu unbound
#   (that check needs tenantvmd's test-hooks feature: without it the scenario skips)
# limit: 420
# sets: ci
. "$NH_LIB"
need_kvm
edu="$(pci_devices 1234 11e8 | sed -n 1p)"
[ -n "$edu" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$(iommu_group "$edu")" ] || skip "no IOMMU (intel_iommu=on) for $edu"
need_modules vfio_pci vfio_iommu_type1
# tenantvmd puts each tenant in a cgroup of its own (memory, cpu, pids).
if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "cannot mount cgroup2"
fi
for c in cpu memory pids io; do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || step "controller $c not enabled"
done
# edu starts on no driver, as the outer guest boots it; left so whatever happens.
unbind_vfio "$edu"
trap 'unbind_vfio "$edu"' EXIT
run_or_fail "$NH_BIN/nh-gpu-tenant" "$edu"
# A release outer root has no crash hook in tenantvmd: the crash check did not run.
[ ! -f "$NH_WORK/crash-check-skipped" ] || skip "$(cat "$NH_WORK/crash-check-skipped")"
