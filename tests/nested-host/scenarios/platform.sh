#!/bin/sh
# description: the host has what the other scenarios build on: /dev/kvm, an IOMMU with the
#   two edu devices, the nvme device and the SR-IOV nvme (8086:5845, 2 VFs) in groups of
#   their own, vfio, vhost-vsock, dm-crypt
# limit: 60
# sets: ci
. "$NH_LIB"

need_kvm
step "/dev/kvm present"
need_modules vfio_pci vfio_iommu_type1 vhost_vsock dm_crypt loop
[ -c /dev/vfio/vfio ] || fail "/dev/vfio/vfio is missing after loading vfio"
[ -c /dev/vhost-vsock ] || fail "/dev/vhost-vsock is missing after loading vhost_vsock"
[ -c /dev/mapper/control ] || fail "/dev/mapper/control is missing after loading dm_crypt"
[ -d /sys/kernel/iommu_groups ] && [ -n "$(ls /sys/kernel/iommu_groups)" ] ||
    fail "no IOMMU groups (is the IOMMU on? intel_iommu=on)"
if [ "$NH_HOST" = nested ]; then
    edus="$(pci_devices 1234 11e8)"
    nvmes="$(pci_devices 1b36 0010)"
    pfs="$(pci_devices 8086 5845)"
    [ "$(echo "$edus" | wc -w)" = 2 ] || fail "expected two edu devices, found: ${edus:-none}"
    [ "$(echo "$nvmes" | wc -w)" = 1 ] || fail "expected one nvme device, found: ${nvmes:-none}"
    [ "$(echo "$pfs" | wc -w)" = 1 ] || fail "expected one SR-IOV nvme (8086:5845), found: ${pfs:-none}"
    total="$(cat "/sys/bus/pci/devices/$pfs/sriov_totalvfs" 2>/dev/null)"
    [ "$total" = 2 ] || fail "the SR-IOV nvme $pfs offers ${total:-no} VFs, expected 2"
    groups=""
    for d in $edus $nvmes $pfs; do
        g="$(iommu_group "$d")"
        [ -n "$g" ] || fail "$d is in no IOMMU group"
        members="$(ls "/sys/kernel/iommu_groups/$g/devices" | wc -w)"
        [ "$members" = 1 ] || fail "$d shares IOMMU group $g with $((members - 1)) other device(s)"
        case " $groups " in *" $g "*) fail "IOMMU group $g holds two of the devices" ;; esac
        groups="$groups $g"
        step "$d: IOMMU group $g, reset methods: $(cat "/sys/bus/pci/devices/$d/reset_method" 2>/dev/null || echo none)"
    done
fi
step "IOMMU groups: $(ls /sys/kernel/iommu_groups | wc -w)"
