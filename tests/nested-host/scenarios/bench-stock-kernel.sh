#!/bin/sh
# description: benchmark (scripts/bench.sh): the stock kernel (bzImage, busybox initramfs)
#   to userspace under tenantvm-vmm and under qemu-system-x86_64 -M microvm -accel kvm in the
#   same run, 3 runs each; the ratio is the figure
# limit: 1200
# sets: bench
# needs: qemu
. "$NH_LIB"
need_kvm
run_or_fail "$NH_BIN/nh-stock-kernel" bench 3 qemu-system-x86_64
