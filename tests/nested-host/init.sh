#!/bin/busybox sh
# PID 1 of the nested host's outer guest (QEMU TCG, q35, intel-iommu; see
# docs/testing.md). Two stages:
#   1. in the small initramfs of the ext4 format (marked by /nh-stage1): load virtio and
#      ext4, mount the root disk (serial nh-root) read-only and switch to it;
#   2. in the root: load the host's modules (KVM, vfio, vhost-vsock, dm-crypt, loop), mount
#      the scratch disk (serial nh-scratch), run the scenarios named by nh.run= on the
#      kernel command line through run-scenarios.sh with the results going to the
#      virtio-serial port org.tenantvm.nested.results (after a READY line with the uptime),
#      then power off.
# Anything going wrong here is printed on the console and ends in a power-off: the host
# side then reports the console tail.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
B=/bin/busybox

say() { $B echo "nested-host init: $*"; }
die() { say "FATAL: $*"; $B sync; $B poweroff -f; $B sleep 10; exit 1; }
uptime_s() { $B cut -d' ' -f1 /proc/uptime; }

# The virtio block device whose serial is $1 (QEMU's -device virtio-blk-pci,serial=...).
disk_with_serial() {
    for s in /sys/block/vd*/serial; do
        [ -f "$s" ] || continue
        if [ "$($B cat "$s")" = "$1" ]; then
            d="${s%/serial}"
            echo "/dev/${d##*/}"
            return 0
        fi
    done
    return 1
}

# Waits up to 10 s for the disk with serial $1 (virtio probing is asynchronous).
wait_disk() {
    i=0
    while [ $i -lt 100 ]; do
        disk_with_serial "$1" && return 0
        $B sleep 0.1
        i=$((i + 1))
    done
    return 1
}

$B mkdir -p /proc /sys /dev
[ -e /proc/self ] || $B mount -t proc proc /proc
[ -e /sys/kernel ] || $B mount -t sysfs sysfs /sys
[ -e /dev/null ] || $B mount -t devtmpfs devtmpfs /dev

if [ -e /nh-stage1 ]; then
    say "stage 1 at $(uptime_s) s"
    # ext4's metadata checksums need a crc32c driver; nothing asks for it by alias here.
    for m in virtio_pci virtio_blk crc32c_generic ext4; do
        $B modprobe "$m" || die "modprobe $m failed"
    done
    root_dev="$(wait_disk nh-root)" || die "no virtio disk with serial nh-root"
    $B mount -t ext4 -o ro "$root_dev" /newroot || die "cannot mount $root_dev"
    $B mount --move /dev /newroot/dev
    $B umount /proc /sys
    exec $B switch_root /newroot /init
fi

say "root at $(uptime_s) s"
$B mount -t tmpfs -o mode=1777 tmpfs /tmp
$B mount -t tmpfs -o mode=0755 tmpfs /run
$B mkdir -p /dev/pts /dev/shm
$B mount -t devpts devpts /dev/pts
$B mount -t tmpfs tmpfs /dev/shm
$B hostname nested-host

# The host's modules. kvm_amd: QEMU's `-cpu max` emulates AMD SVM with nested paging.
for m in virtio_pci virtio_blk virtio_console crc32c_generic ext4 kvm_amd vhost_vsock vfio_pci \
         vfio_iommu_type1 dm_crypt loop; do
    $B modprobe "$m" || say "modprobe $m failed"
done
[ -c /dev/kvm ] || say "no /dev/kvm after loading kvm_amd"
# Inner guests touch their RAM sparsely (the VMM's memory tests write one word per 2 MiB of
# a 5 GiB guest); transparent huge pages would back each touch with 2 MiB of this guest's
# few GiB.
echo never >/sys/kernel/mm/transparent_hugepage/enabled

scratch_dev="$(wait_disk nh-scratch)" || die "no virtio disk with serial nh-scratch"
$B mkdir -p /scratch
$B mount -t ext4 "$scratch_dev" /scratch || die "cannot mount the scratch disk $scratch_dev"

# The virtio-serial port named $1 (QEMU's virtserialport,name=...), waiting up to 10 s.
virtio_port() {
    i=0
    while [ $i -lt 100 ]; do
        for n in /sys/class/virtio-ports/*/name; do
            [ -f "$n" ] || continue
            if [ "$($B cat "$n")" = "$1" ]; then
                p="${n%/name}"
                [ -c "/dev/${p##*/}" ] && echo "/dev/${p##*/}" && return 0
            fi
        done
        $B sleep 0.1
        i=$((i + 1))
    done
    return 1
}
results="$(virtio_port org.tenantvm.nested.results)" ||
    die "no virtio-serial port org.tenantvm.nested.results"

# The heartbeat: a line with the uptime every 5 s on a port of its own. It needs the kernel's
# timers, its scheduler and an interrupt-driven virtio queue, so when the outer guest stops
# (a lost timer, interrupts that never arrive) the host side sees the silence within seconds
# and saves the guest's state. The host writes a byte a second the other way: that device
# interrupt is what recovers a timer interrupt QEMU's TCG lost (docs/testing.md, "A frozen
# outer guest").
if heartbeat="$(virtio_port org.tenantvm.nested.heartbeat)"; then
    (
        trap '' HUP
        exec 3<>"$heartbeat"
        # The host's nudges (one byte a second: a device interrupt that recovers an interrupt
        # QEMU lost; docs/testing.md) are read and dropped.
        $B cat <&3 >/dev/null &
        last=""
        while :; do
            now="$(uptime_s)"
            echo "HB $now" >&3
            # A gap the guest lived through (the host may not have caught it): its own view
            # of its timers and interrupts then, on the console.
            if [ -n "$last" ] && $B awk -v a="$last" -v b="$now" 'BEGIN { exit !(b - a > 20) }'; then
                say "heartbeat gap: uptime $last -> $now s; timers and interrupts now:"
                $B head -n 60 /proc/timer_list
                $B cat /proc/interrupts
            fi
            last="$now"
            $B sleep 5
        done
    ) </dev/null >/dev/console 2>&1 &
else
    say "no virtio-serial port org.tenantvm.nested.heartbeat: the host cannot tell a frozen guest early"
fi

run=""
for arg in $($B cat /proc/cmdline); do
    case "$arg" in nh.run=*) run="${arg#nh.run=}" ;; esac
done
[ -n "$run" ] || die "no nh.run= on the kernel command line"

set -a
. /opt/nested-host/env
set +a
export NH_HOST=nested NH_WORK_ROOT=/scratch/work HOME=/root TMPDIR=/scratch/tmp
$B mkdir -p "$NH_WORK_ROOT" "$TMPDIR"
say "ready at $(uptime_s) s; scenarios: $run"
echo "READY $(uptime_s)" >>"$results"
/opt/nested-host/run-scenarios.sh "$results" $(echo "$run" | $B tr ',' ' ')
say "scenarios done at $(uptime_s) s"
$B sync
$B umount /scratch
$B poweroff -f
