#!/bin/sh
# description: edu's INTx (MSI off) under tenantvm-vmm with kernel VFIO, three times, unmasked
#   at each EOI through KVM's resample eventfd and routed by the VMM's _PRT rule. Not in ci:
#   in one CI dry run of the vfio-passthrough scenario the whole outer guest stopped answering
#   during this step (not even the step's own timeout fired), once in three runs; run it by
#   name (scripts/nested-host.sh vfio-intx) until that is understood.
# limit: 180
. "$NH_LIB"
need_kvm
edu1="$(pci_devices 1234 11e8 | sed -n 1p)"
[ -n "$edu1" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$(iommu_group "$edu1")" ] || skip "no IOMMU (intel_iommu=on) for $edu1"
need_modules vfio_pci vfio_iommu_type1
trap 'unbind_vfio "$edu1"' EXIT
vmm="$NH_BIN/tenantvm-vmm"
guest="$NH_TEST_GUESTS/tvm-testguest"
bind_vfio "$edu1"

# INTx: edu with MSI left off, its line routed by the VMM's _PRT rule, unmasked at each EOI.
timeout 120 "$vmm" --kernel "$guest" --memory-mib 128 --serial "file:$NH_WORK/intx.log" \
    --cmdline "console=ttyS0 tvm.test=vfio-edu-intx" \
    --device "vfio,path=/sys/bus/pci/devices/$edu1" 2>"$NH_WORK/intx.err" ||
    fail "the INTx VM exited $?: $(cat "$NH_WORK/intx.err") $(tail -n 3 "$NH_WORK/intx.log")"
line="$(grep -m 1 'TVMTEST vfio-edu-intx' "$NH_WORK/intx.log")"
step "edu INTx: $line"
case "$line" in *"vfio-edu-intx PASS"*) ;; *) fail "edu INTx: ${line:-no report}" ;; esac

