#!/bin/sh
# The nested host's stand-in for what NVIDIA's driver does to one of its VFs when a vGPU
# type is set on it (and cleared): the SIMULATED vGPU driver runs it as a GPU's `vf_hook`
# (orchestrator/gpu/src/backend/sim/vendor.rs) for QEMU's SR-IOV nvme, whose virtual
# functions' controllers need resources and an online state before a VM can use them.
#
# usage: nvme-vf.sh online|offline PF VF
#   online   gives VF's secondary controller 2 queue and 1 interrupt resources and brings it
#            online (nvme-cli virt-mgmt: resource type 0 = queues, 1 = interrupts; action 8
#            assign, 9 online); nothing to do when it is online already
#   offline  takes it offline (action 7); its resources stay assigned
# The PF must be on the nvme driver with its flexible resources released (the
# gpu-vgpu-sriov scenario does that). Each call appends "ACTION PF VF" to
# $NH_WORK/vf-hook.log. Exits non-zero with the reason on stderr.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
action="$1" pf="$2" vf="$3"
die() { echo "nvme-vf: $*" >&2; exit 1; }
case "$action" in online|offline) ;; *) die "usage: nvme-vf.sh online|offline PF VF" ;; esac
[ -n "$pf" ] && [ -n "$vf" ] || die "usage: nvme-vf.sh online|offline PF VF"
[ -n "${NH_WORK:-}" ] && echo "$action $pf $vf" >>"$NH_WORK/vf-hook.log"

ctrl="$(ls "/sys/bus/pci/devices/$pf/nvme" 2>/dev/null | head -n 1)"
[ -n "$ctrl" ] || die "$pf has no NVMe controller: is it on the nvme driver?"
dev="/dev/$ctrl"
# The VF's number (1-based) from the PF's virtfnN link to it.
vfn=""
for link in "/sys/bus/pci/devices/$pf"/virtfn*; do
    [ "$(basename "$(readlink "$link")")" = "$vf" ] && vfn=$((${link##*virtfn} + 1))
done
[ -n "$vfn" ] || die "$vf is not a VF of $pf"
# Its secondary controller: id and state, from the PF's secondary controller list.
list="$(nvme list-secondary "$dev" 2>&1)" || die "nvme list-secondary $dev: $list"
entries="$(printf '%s\n' "$list" | awk '
    /SCID/ { scid = $NF }
    /SCS/ { for (i = 1; i <= NF; i++) if ($i ~ /^0x/) scs = $i }
    /VFN/ { print scid, scs, $NF }')"
scid="" scs=""
while read -r id state n; do
    [ -n "$n" ] && [ "$((n))" = "$vfn" ] && scid="$((id))" scs="$state"
done <<EOF
$entries
EOF
[ -n "$scid" ] || die "nvme list-secondary $dev names no VF $vfn: $list"

mgmt() { # RESOURCE-TYPE ACTION COUNT
    out="$(nvme virt-mgmt "$dev" -c "$scid" -r "$1" -a "$2" -n "$3" 2>&1)" ||
        die "nvme virt-mgmt $dev -c $scid -r $1 -a $2 -n $3: $out"
}
case "$action" in
    online)
        [ "$((scs & 1))" = 1 ] && exit 0
        mgmt 0 8 2
        mgmt 1 8 1
        mgmt 0 9 0
        ;;
    offline)
        [ "$((scs & 1))" = 0 ] && exit 0
        mgmt 0 7 0
        ;;
esac
exit 0
