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
need_edu
# tenantvmd puts each tenant in a cgroup of its own (memory, cpu, pids).
need_tenant_cgroups
# edu starts on no driver, as the outer guest boots it; left so whatever happens.
unbind_vfio "$edu"
trap 'unbind_vfio "$edu"' EXIT
run_or_fail "$NH_BIN/nh-gpu-tenant" "$edu"
# A release outer root has no crash hook in tenantvmd: the crash check did not run.
[ ! -f "$NH_WORK/crash-check-skipped" ] || skip "$(cat "$NH_WORK/crash-check-skipped")"
