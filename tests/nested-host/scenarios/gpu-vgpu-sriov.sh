#!/bin/sh
# description: the daemon's MIG-backed vGPU route on a real SR-IOV PF: a SIMULATED host file
#   puts an H100 with SR-IOV vGPU at the address of QEMU's SR-IOV nvme (--gpu-sysfs-root /);
#   tenantvm create with gpu = { profile = "1g.10gb" } enables the PF's VFs through
#   sriov_numvfs (real), the simulated vGPU type on a real VF brings its controller online
#   (nvme-cli virt-mgmt, the GPU's vf_hook) and binds it to vfio-pci, tenantvm-vmm passes it
#   through and the test guest gets Identify from that VF's secondary controller; a second
#   tenant gets the other VF; the first's destroy gives its VF back and keeps the VFs, the
#   last's disables them, and each receipt says which parts were real and which simulated;
#   a SIGKILL of tenantvmd between bind-gpu and attach-gpu, then a restart, converges with
#   the VFs disabled (needs tenantvmd's test-hooks feature: without it the scenario skips)
# limit: 420
# needs: /usr/sbin/nvme
. "$NH_LIB"
need_kvm
need_sriov_nvme
need_tenant_cgroups
hook="$(dirname "$NH_LIB")/nvme-vf.sh"
trap 'release_sriov_nvme' EXIT
run_or_fail "$NH_BIN/nh-vgpu-sriov" "$pf" "$hook"
# A release outer root has no crash hook in tenantvmd: the crash check did not run.
[ ! -f "$NH_WORK/crash-check-skipped" ] || skip "$(cat "$NH_WORK/crash-check-skipped")"
