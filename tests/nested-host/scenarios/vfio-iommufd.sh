#!/bin/sh
# description: tenantvm-vmm passes QEMU's edu through over iommufd and the VFIO cdev
#   (/dev/iommu, /dev/vfio/devices/vfioN) on an outer-guest kernel built with
#   scripts/build-iommufd-kernel.sh: with iommu=iommufd the no_std test guest reads edu's ID,
#   computes a factorial, receives its MSI and makes it DMA both ways, and the exit report
#   says iommufd; iommu=auto picks iommufd too; iommu=legacy still passes on that kernel.
#   Skips on a kernel without iommufd (Debian's). Run by name:
#   TENANTVM_KERNEL_DIR=.cache/kernel-iommufd scripts/nested-host.sh vfio-iommufd
# limit: 300
. "$NH_LIB"
build_hint="build the kernel with scripts/build-iommufd-kernel.sh, then run TENANTVM_KERNEL_DIR=.cache/kernel-iommufd scripts/nested-host.sh vfio-iommufd"
need_kvm
need_edu
[ -e /dev/iommu ] || modprobe iommufd 2>/dev/null
[ -c /dev/iommu ] || skip "the outer guest's kernel $(uname -r) has no iommufd (/dev/iommu): $build_hint"
trap 'unbind_vfio "$edu"' EXIT
bind_vfio "$edu"
sys="/sys/bus/pci/devices/$edu"
cdev="$(ls "$sys/vfio-dev" 2>/dev/null | grep -m 1 '^vfio[0-9]')"
[ -n "$cdev" ] || fail "edu $edu bound to vfio-pci has no $sys/vfio-dev/vfioN"
[ -c "/dev/vfio/devices/$cdev" ] || skip "kernel $(uname -r) has iommufd but no VFIO cdev /dev/vfio/devices/$cdev (CONFIG_VFIO_DEVICE_CDEV): $build_hint"
step "kernel $(uname -r): /dev/iommu, edu $edu (group $(iommu_group "$edu")) with cdev /dev/vfio/devices/$cdev"

vmm="$NH_BIN/tenantvm-vmm"
guest="$NH_TEST_GUESTS/tvm-testguest"
# The vfio-passthrough scenario's edu guest run, with the device's iommu option $1; checks
# the guest's report, edu's reset recorded as unsupported, and the interface the exit
# report names ($2).
run_edu() { # MODE INTERFACE
    name="edu-$1"
    timeout 120 "$vmm" --kernel "$guest" --memory-mib 128 --serial "file:$NH_WORK/$name.log" \
        --cmdline "console=ttyS0 tvm.test=vfio-edu" \
        --device "vfio,path=$sys,iommu=$1" --exit-report "$NH_WORK/$name.json" \
        2>"$NH_WORK/$name.err"
    rc=$?
    line="$(grep -m 1 'TVMTEST vfio-edu' "$NH_WORK/$name.log" 2>/dev/null)"
    step "iommu=$1: exit $rc: $line"
    [ "$rc" = 0 ] || fail "iommu=$1: the VM exited $rc: $(cat "$NH_WORK/$name.err") $(tail -n 3 "$NH_WORK/$name.log" 2>/dev/null)"
    case "$line" in *"vfio-edu PASS"*) ;; *) fail "iommu=$1: ${line:-no report}" ;; esac
    grep -q "\"interface\": \"$2\"" "$NH_WORK/$name.json" ||
        fail "iommu=$1: the exit report does not say interface $2: $(tr -d ' \n' <"$NH_WORK/$name.json")"
    grep -q '"outcome": "unsupported"' "$NH_WORK/$name.json" ||
        fail "iommu=$1: edu's reset not recorded as unsupported: $(tr -d ' \n' <"$NH_WORK/$name.json")"
    step "iommu=$1: exit report $(tr -d ' \n' <"$NH_WORK/$name.json")"
}
run_edu iommufd iommufd
run_edu auto iommufd
run_edu legacy legacy
