#!/bin/sh
# description: tenantvm-vmm boots the stock Debian kernel with a small initramfs to
#   userspace: vmlinux through PVH on 1 vCPU and its 64-bit entry on 2, the bzImage on 1
#   and on 2; Linux binds virtio_pci, virtio_blk, virtio_rng and
#   vmw_vsock_virtio_transport, a disk pattern reads back and lands in the host file, the
#   rng reads, vsock round trips both ways through the hybrid socket, ACPI power-off exits
#   0 and a reboot exits 3
# limit: 600
# sets: ci
. "$NH_LIB"
need_kvm
run_or_fail "$NH_BIN/nh-stock-kernel" check
