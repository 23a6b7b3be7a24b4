#!/bin/sh
# description: benchmark: a vGPU tenant on a real SR-IOV VF (gpu-vgpu-sriov's setup: the
#   vGPU type SIMULATED) against a whole-device tenant (QEMU's plain nvme given whole), the
#   same test guest, NH_VGPU_ROUNDS rounds (default 3) of each, each on a fresh daemon:
#   create-to-running medians, their ratio and the create steps, as NOTE lines
# limit: 900
# sets: bench
# needs: /usr/sbin/nvme
. "$NH_LIB"
need_kvm
need_sriov_nvme
need_tenant_cgroups
nvme="$(pci_devices 1b36 0010 | head -n 1)"
[ -n "$nvme" ] || skip "no QEMU nvme device (1b36:0010): it exists on the nested host only"
unbind_vfio "$nvme"
trap 'unbind_vfio "$nvme"; release_sriov_nvme' EXIT
run_or_fail "$NH_BIN/nh-vgpu-sriov" bench "$pf" "$(dirname "$NH_LIB")/nvme-vf.sh" "$nvme" "${NH_VGPU_ROUNDS:-3}"
