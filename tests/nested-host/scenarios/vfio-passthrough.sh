#!/bin/sh
# description: tenantvm-vmm passes QEMU's edu through with kernel VFIO (its own backend): the
#   no_std test guest reads edu's ID, computes a factorial, receives its MSI and makes it DMA
#   into and out of guest RAM; a second edu in a second VM at the same time; the exit report
#   records edu's missing reset as unsupported; the guest brings nvme up and gets its
#   Identify completion by MSI-X, and nvme's FLR at attach and detach is recorded; a device
#   left on no VFIO driver is refused with status 22; NVIDIA's GPUDirect clique on edu is
#   refused with status 2; iommu=iommufd on a kernel without iommufd is refused with status
#   24; the stock kernel with a busybox initramfs lists edu with its
#   host ids (1234:11e8)
# limit: 300
# sets: ci
. "$NH_LIB"
need_kvm
edu1="$(pci_devices 1234 11e8 | sed -n 1p)"
edu2="$(pci_devices 1234 11e8 | sed -n 2p)"
nvme="$(pci_devices 1b36 0010 | head -n 1)"
[ -n "$edu1" ] && [ -n "$edu2" ] || skip "fewer than two edu devices (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$nvme" ] || skip "no QEMU nvme device (1b36:0010): it exists on the nested host only"
[ -n "$(iommu_group "$edu1")" ] || skip "no IOMMU (intel_iommu=on) for $edu1"
need_modules vfio_pci vfio_iommu_type1
trap 'unbind_vfio "$edu1"; unbind_vfio "$edu2"; unbind_vfio "$nvme"' EXIT
vmm="$NH_BIN/tenantvm-vmm"
guest="$NH_TEST_GUESTS/tvm-testguest"

# A device on no VFIO driver is refused before anything is opened.
unbind_vfio "$edu1"
"$vmm" --kernel "$guest" --serial none --device "vfio,path=/sys/bus/pci/devices/$edu1" \
    2>"$NH_WORK/refused.err" && fail "an unbound edu was accepted"
rc=$?
[ "$rc" = 22 ] || fail "an unbound edu exited $rc, not 22: $(cat "$NH_WORK/refused.err")"
step "unbound edu refused: $(cat "$NH_WORK/refused.err")"

bind_vfio "$edu1"
bind_vfio "$edu2"
bind_vfio "$nvme"
step "edu $edu1, edu $edu2, nvme $nvme bound to vfio-pci"

# NVIDIA's GPUDirect clique capability is refused on edu (vendor 0x1234), naming the vendor.
"$vmm" --kernel "$guest" --serial none \
    --device "vfio,path=/sys/bus/pci/devices/$edu1,gpudirect_clique=1" \
    2>"$NH_WORK/clique.err" && fail "gpudirect_clique on edu was accepted"
rc=$?
[ "$rc" = 2 ] && grep -q "0x1234" "$NH_WORK/clique.err" ||
    fail "gpudirect_clique on edu exited $rc: $(cat "$NH_WORK/clique.err")"
step "gpudirect_clique on edu refused: $(cat "$NH_WORK/clique.err")"

# iommu=iommufd on a kernel without iommufd (Debian's) is refused with status 24, saying what
# is missing and that iommu=legacy is the way out (vfio-iommufd runs the path where it exists).
if [ ! -e /dev/iommu ]; then
    "$vmm" --kernel "$guest" --serial none \
        --device "vfio,path=/sys/bus/pci/devices/$edu1,iommu=iommufd" \
        2>"$NH_WORK/iommufd.err" && fail "iommu=iommufd was accepted without /dev/iommu"
    rc=$?
    [ "$rc" = 24 ] && grep -q "iommu=legacy" "$NH_WORK/iommufd.err" ||
        fail "iommu=iommufd without iommufd exited $rc: $(cat "$NH_WORK/iommufd.err")"
    step "iommu=iommufd refused without iommufd: $(cat "$NH_WORK/iommufd.err")"
fi

run_edu() { # NAME DEVICE
    timeout 120 "$vmm" --kernel "$guest" --memory-mib 128 --serial "file:$NH_WORK/$1.log" \
        --cmdline "console=ttyS0 tvm.test=vfio-edu" \
        --device "vfio,path=/sys/bus/pci/devices/$2" --exit-report "$NH_WORK/$1.json" \
        2>"$NH_WORK/$1.err"
    echo $? >"$NH_WORK/$1.rc"
}
run_edu vm1 "$edu1" &
run_edu vm2 "$edu2" &
wait
for vm in vm1 vm2; do
    rc="$(cat "$NH_WORK/$vm.rc")"
    line="$(grep -m 1 'TVMTEST vfio-edu' "$NH_WORK/$vm.log" 2>/dev/null)"
    step "$vm: exit $rc: $line"
    [ "$rc" = 0 ] || fail "$vm exited $rc: $(cat "$NH_WORK/$vm.err") $(tail -n 3 "$NH_WORK/$vm.log" 2>/dev/null)"
    case "$line" in *"vfio-edu PASS"*) ;; *) fail "$vm: ${line:-no report}" ;; esac
    grep -q '"outcome": "unsupported"' "$NH_WORK/$vm.json" ||
        fail "$vm: edu's reset not recorded as unsupported: $(cat "$NH_WORK/$vm.json")"
done

timeout 120 "$vmm" --kernel "$guest" --memory-mib 128 --serial "file:$NH_WORK/nvme.log" \
    --cmdline "console=ttyS0 tvm.test=vfio-nvme" \
    --device "vfio,path=/sys/bus/pci/devices/$nvme" --exit-report "$NH_WORK/nvme.json" \
    2>"$NH_WORK/nvme.err" || fail "the VM with nvme exited $?: $(cat "$NH_WORK/nvme.err") $(tail -n 3 "$NH_WORK/nvme.log")"
line="$(grep -m 1 'TVMTEST vfio-nvme' "$NH_WORK/nvme.log")"
step "nvme: $line"
case "$line" in *"vfio-nvme PASS"*) ;; *) fail "nvme: ${line:-no report}" ;; esac
resets="$(grep -c '"outcome": "reset"' "$NH_WORK/nvme.json")"
[ "$resets" = 2 ] || fail "nvme: expected a reset at attach and at detach: $(cat "$NH_WORK/nvme.json")"
step "nvme reset at attach and detach: $(tr -d ' \n' <"$NH_WORK/nvme.json")"

# The stock kernel (busybox initramfs) lists edu with its host ids, lspci -nn style.
run_or_fail "$NH_BIN/nh-stock-kernel" vfio "/sys/bus/pci/devices/$edu1"
step "the stock kernel lists edu $edu1 as 1234:11e8"
