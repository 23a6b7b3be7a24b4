#!/bin/sh
# description: benchmark: what huge pages change for a tenant with a device: QEMU's plain
#   nvme given whole (a SIMULATED whole-only GPU at its address, --gpu-sysfs-root /) to a
#   tenant of NH_HUGEPAGE_MIB MiB (default 512; several sizes separated by spaces) on
#   4 KiB, 2 MiB and 1 GiB pages (each pool reserved at run time; one the outer guest
#   cannot fill is a NOTE): the VMM's DMA-map time and create-to-running, each against
#   4 KiB's, as NOTE lines. Larger sizes need a larger outer guest (--memory-mib); and
#   the daemon gives a VM 10 s to answer on its control socket, which on 4 KiB pages
#   includes pinning its RAM for DMA: in the nested host that took 4.7-8.7 s for 1024 MiB
#   and more than 10 s for 2048 MiB (the launch failed), hence 512
# limit: 1200
# sets: bench
. "$NH_LIB"
need_kvm
need_tenant_cgroups
need_modules vfio_pci vfio_iommu_type1
nvme="$(pci_devices 1b36 0010 | head -n 1)"
[ -n "$nvme" ] || skip "no QEMU nvme device (1b36:0010): it exists on the nested host only"
[ -n "$(iommu_group "$nvme")" ] || skip "no IOMMU (intel_iommu=on) for $nvme"
unbind_vfio "$nvme"
trap 'unbind_vfio "$nvme"' EXIT
step "free memory: $(awk '/MemFree/ {print $2 / 1024 " MiB"}' /proc/meminfo)"
# shellcheck disable=SC2086
run_or_fail "$NH_BIN/nh-vfio-hugepages" "$nvme" ${NH_HUGEPAGE_MIB:-512}
