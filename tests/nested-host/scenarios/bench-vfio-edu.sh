#!/bin/sh
# description: benchmark (scripts/bench-vfio.sh): MSI round trips per second with QEMU's edu
#   passed through, the same test guest (tvm.test=vfio-edu-bench) under tenantvm-vmm and
#   under QEMU's vfio-pci (q35, KVM), in the same boot
# limit: 600
# sets: bench
# needs: qemu
. "$NH_LIB"
need_kvm
edu="$(pci_devices 1234 11e8 | head -n 1)"
[ -n "$edu" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
[ -n "$(iommu_group "$edu")" ] || skip "no IOMMU (intel_iommu=on) for $edu"
need_modules vfio_pci vfio_iommu_type1
trap 'unbind_vfio "$edu"' EXIT
bind_vfio "$edu"
n="${NH_EDU_ROUNDS:-2000}"
cmdline="console=ttyS0 tvm.test=vfio-edu-bench tvm.n=$n"
rate() { sed -n 's/.*vfio-edu-bench PASS .*per_second=\([0-9]*\).*/\1/p' "$1" | head -n 1; }

for run in 1 2 3; do
    timeout 120 "$NH_BIN/tenantvm-vmm" --kernel "$NH_TEST_GUESTS/tvm-testguest" --memory-mib 128 \
        --serial "file:$NH_WORK/vmm$run.log" --cmdline "$cmdline" \
        --device "vfio,path=/sys/bus/pci/devices/$edu" 2>"$NH_WORK/vmm$run.err"
    timeout 180 qemu-system-x86_64 -M q35 -accel kvm -cpu host -m 128 -smp 1 -nodefaults \
        -display none -no-reboot -serial "file:$NH_WORK/qemu$run.log" \
        -device isa-debug-exit,iobase=0xf4,iosize=4 \
        -kernel "$NH_TEST_GUESTS/tvm-testguest" -append "$cmdline" \
        -device "vfio-pci,host=$edu" 2>"$NH_WORK/qemu$run.err"
    v="$(rate "$NH_WORK/vmm$run.log")"
    q="$(rate "$NH_WORK/qemu$run.log")"
    [ -n "$v" ] || fail "tenantvm-vmm run $run: $(tail -n 2 "$NH_WORK/vmm$run.log" "$NH_WORK/vmm$run.err" 2>/dev/null | tr '\n' ' ')"
    [ -n "$q" ] || fail "QEMU run $run: $(tail -n 2 "$NH_WORK/qemu$run.log" "$NH_WORK/qemu$run.err" 2>/dev/null | tr '\n' ' ')"
    step "run $run: tenantvm-vmm $v/s, QEMU vfio-pci $q/s"
    echo "edu MSI round trips, run $run ($n each): tenantvm-vmm $v/s, QEMU vfio-pci $q/s" >>"$NH_NOTES"
done
