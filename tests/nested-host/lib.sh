# Helpers for nested-host scenarios (POSIX sh: busybox inside the outer guest, dash or bash
# on a real host). A scenario sources it with `. "$NH_LIB"`.
#
# Paths a scenario gets (the same names on both hosts; docs/testing.md):
#   NH_HOST         nested (the outer QEMU guest) or real
#   NH_BIN          tenantvm-vmm, tenantvm, tenantvmd, tenantvm-jail and the nh-* programs
#   NH_GUEST_TOOLS  static programs for inner Linux guests (nh-vsock-echo)
#   NH_KERNEL_DIR   the stock kernel: vmlinuz, vmlinux, version, modules/
#   NH_GUEST_IMAGE  the guest image set (guest-image/build.sh)
#   NH_TEST_GUESTS  the no_std test guests (scripts/build-test-guests.sh)
#   NH_KVM_TESTS_LIST  a file listing the VMM's KVM test binaries (vmm/tests/guest_*.rs)
#   NH_WORK         an empty folder for this scenario's files (on the scratch disk)
#   NH_REASON       where `fail` and `skip` write their reason
#   NH_NOTES        lines written here come back as NOTE lines (benchmark figures)

# Ends the scenario as failed, with a one-line reason.
fail() {
    printf '%s\n' "$*" >"$NH_REASON"
    echo "FAIL: $*" >&2
    exit 1
}

# Ends the scenario as skipped (it cannot run on this host), with the reason.
skip() {
    printf '%s\n' "$*" >"$NH_REASON"
    echo "SKIP: $*" >&2
    exit 77
}

# Prints a progress line with the time since boot.
step() {
    echo "$NH_SCENARIO ($(cut -d' ' -f1 /proc/uptime) s): $*"
}

# Skips unless /dev/kvm can be opened.
need_kvm() {
    [ -c /dev/kvm ] && [ -r /dev/kvm ] && [ -w /dev/kvm ] || skip "/dev/kvm is not usable here"
}

# Loads kernel modules (already loaded or built in is fine).
need_modules() {
    for m in "$@"; do
        [ -d "/sys/module/$m" ] || modprobe "$m" 2>/dev/null || fail "cannot load kernel module $m"
    done
}

# cgroup v2 mounted with the controllers tenantvmd puts each tenant under (memory, cpu,
# pids, io); a controller the kernel lacks is a step line, not a failure.
need_tenant_cgroups() {
    if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
        mkdir -p /sys/fs/cgroup
        mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "cannot mount cgroup2"
    fi
    for c in cpu memory pids io; do
        echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || step "controller $c not enabled"
    done
}

# The PCI addresses (0000:00:03.0 ...) of devices with vendor $1 and device $2 (hex, no 0x).
pci_devices() {
    for d in /sys/bus/pci/devices/*; do
        [ "$(cat "$d/vendor")" = "0x$1" ] && [ "$(cat "$d/device")" = "0x$2" ] && echo "${d##*/}"
    done
    return 0
}

# The IOMMU group number of PCI device $1, or nothing without an IOMMU.
iommu_group() {
    g="$(readlink "/sys/bus/pci/devices/$1/iommu_group" 2>/dev/null)" || return 0
    echo "${g##*/}"
}

# Sets $edu to the first QEMU edu device (1234:11e8) behind an IOMMU, with vfio's modules
# loaded; skips where there is none (it exists on the nested host only).
need_edu() {
    edu="$(pci_devices 1234 11e8 | sed -n 1p)"
    [ -n "$edu" ] || skip "no edu device (1234:11e8): QEMU's edu exists on the nested host only"
    [ -n "$(iommu_group "$edu")" ] || skip "no IOMMU (intel_iommu=on) for $edu"
    need_modules vfio_pci vfio_iommu_type1
}

# Binds PCI device $1 to vfio-pci (driver_override, then drivers_probe).
bind_vfio() {
    dev="/sys/bus/pci/devices/$1"
    if [ -e "$dev/driver" ]; then
        [ "$(basename "$(readlink "$dev/driver")")" = vfio-pci ] && return 0
        echo "$1" >"$dev/driver/unbind" || fail "cannot unbind $1 from its driver"
    fi
    echo vfio-pci >"$dev/driver_override" || fail "cannot set driver_override of $1"
    echo "$1" >/sys/bus/pci/drivers_probe
    [ "$(basename "$(readlink "$dev/driver" 2>/dev/null)")" = vfio-pci ] || fail "$1 did not bind to vfio-pci"
}

# Returns PCI device $1 from vfio-pci to no driver (clears driver_override).
unbind_vfio() {
    dev="/sys/bus/pci/devices/$1"
    [ -e "$dev/driver" ] && echo "$1" >"$dev/driver/unbind"
    echo >"$dev/driver_override"
    return 0
}

# Runs a program, its output shown as it goes; when it fails, ends the scenario with the
# first line of its `FAILED:` message (or its exit status) as the reason.
run_or_fail() {
    log="$NH_WORK/run_or_fail.log"
    rc_file="$NH_WORK/run_or_fail.rc"
    rm -f "$rc_file"
    { "$@"; echo $? >"$rc_file"; } 2>&1 | tee "$log"
    rc="$(cat "$rc_file" 2>/dev/null)"
    [ "$rc" = 0 ] && return 0
    reason="$(grep -m 1 'FAILED: ' "$log" | sed 's/.*FAILED: //')"
    fail "${reason:-$1 exited with status ${rc:-unknown}}"
}

# Sets $pf to QEMU's SR-IOV nvme (8086:5845, the nested host's only) and prepares it as the
# vendor's driver would a GPU for vGPU: the PF on the nvme driver (the plain nvme,
# 1b36:0010, kept off it), its VFs off and left unbound when they appear
# (sriov_drivers_autoprobe 0: vfio-pci takes them), and the flexible queue and interrupt
# resources released by the primary controller (then a function reset), so that its
# secondary controllers can be given them (tests/nested-host/nvme-vf.sh). Skips where the
# device, the IOMMU or nvme-cli is missing.
need_sriov_nvme() {
    pf="$(pci_devices 8086 5845 | sed -n 1p)"
    [ -n "$pf" ] || skip "no SR-IOV nvme (8086:5845): QEMU's exists on the nested host only"
    [ -n "$(iommu_group "$pf")" ] || skip "no IOMMU (intel_iommu=on) for $pf"
    command -v nvme >/dev/null || skip "nvme-cli is not installed (apt-get install nvme-cli)"
    need_modules vfio_pci vfio_iommu_type1
    sriov_dev="/sys/bus/pci/devices/$pf"
    if [ ! -e "$sriov_dev/driver" ]; then
        # Loading nvme binds every NVMe controller it finds: keep the plain one off it.
        plain="$(pci_devices 1b36 0010)"
        for d in $plain; do echo nh-none >"/sys/bus/pci/devices/$d/driver_override"; done
        need_modules nvme
        for d in $plain; do echo >"/sys/bus/pci/devices/$d/driver_override"; done
        echo "$pf" >/sys/bus/pci/drivers_probe 2>/dev/null
    fi
    [ "$(basename "$(readlink "$sriov_dev/driver")")" = nvme ] || fail "$pf did not bind to nvme"
    [ "$(cat "$sriov_dev/sriov_numvfs")" = 0 ] || echo 0 >"$sriov_dev/sriov_numvfs"
    echo 0 >"$sriov_dev/sriov_drivers_autoprobe"
    i=0
    while [ -z "$(ls "$sriov_dev/nvme" 2>/dev/null)" ]; do
        i=$((i + 1)); [ "$i" -le 100 ] || fail "$pf's NVMe controller did not appear"
        sleep 0.1
    done
    sriov_ctrl="/dev/$(ls "$sriov_dev/nvme" | head -n 1)"
    i=0
    while [ ! -c "$sriov_ctrl" ]; do
        i=$((i + 1)); [ "$i" -le 100 ] || fail "$sriov_ctrl did not appear"
        sleep 0.1
    done
    primary="$(nvme id-ctrl "$sriov_ctrl" | awk '/^cntlid/ {print $3}')"
    [ -n "$primary" ] || fail "nvme id-ctrl $sriov_ctrl gave no cntlid"
    for r in 0 1; do
        out="$(nvme virt-mgmt "$sriov_ctrl" -c "$((primary))" -r "$r" -a 1 -n 0 2>&1)" ||
            fail "releasing the primary controller's flexible resources (type $r): $out"
    done
    echo 1 >"$sriov_dev/reset" || fail "the function reset of $pf failed"
    step "$pf: nvme ($sriov_ctrl, primary controller $((primary))), VFs off, flexible resources released, autoprobe off"
}

# Undoes need_sriov_nvme's changes that could outlive the scenario: VFs off.
release_sriov_nvme() {
    [ -n "${sriov_dev:-}" ] && [ "$(cat "$sriov_dev/sriov_numvfs" 2>/dev/null)" != 0 ] &&
        echo 0 >"$sriov_dev/sriov_numvfs"
    return 0
}
