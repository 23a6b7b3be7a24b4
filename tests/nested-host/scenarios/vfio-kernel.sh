#!/bin/sh
# description: vfio-ioctls against the kernel's vfio-pci: an edu device's container, group
#   and device, region info, config space, BAR0 mmapped (ID 0x010000ED), an MSI eventfd
#   that fires on the raise register, DMA through the IOMMU (and blocked once unmapped);
#   the checked VFIO reset succeeds on nvme (FLR) and is refused on edu (no reset method)
# limit: 180
# sets: ci
. "$NH_LIB"
edu="$(pci_devices 1234 11e8 | head -n 1)"
# QEMU's nvme (1b36:0010) exists only in QEMU guests: a real host's NVMe disks never match.
nvme="$(pci_devices 1b36 0010 | head -n 1)"
[ -n "$edu" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$nvme" ] || skip "no QEMU nvme device (1b36:0010): it exists on the nested host only"
[ -n "$(iommu_group "$edu")" ] || skip "no IOMMU (intel_iommu=on) for $edu"
need_modules vfio_pci vfio_iommu_type1
trap 'unbind_vfio "$edu"; unbind_vfio "$nvme"' EXIT
bind_vfio "$edu"
bind_vfio "$nvme"
step "edu $edu (group $(iommu_group "$edu")), nvme $nvme (group $(iommu_group "$nvme")) bound to vfio-pci"
run_or_fail "$NH_BIN/nh-vfio-kernel" --edu "$edu" --nvme "$nvme"
