#!/bin/sh
# description: the guest image's agent reports the GPU it was given: tenantvmd with a
#   SIMULATED host file whose whole-only GPU (an L40S) sits at the PCI address of QEMU's edu
#   (--gpu-sysfs-root /, as gpu-tenant), tenantvm create of a guest-image tenant (tenantvm-vmm,
#   agent over vsock, LUKS2 disk) with gpu = { whole_gpu = true }: edu's IOMMU group goes to
#   vfio-pci and through tenantvm-vmm into the Linux guest; tenantvm gpu-info shows the
#   guest's PCI functions as its agent read them from sysfs, edu (1234:11e8) among them,
#   beside the assignment (the edu's host address and ids), no nvidia-smi in the image, and
#   no mismatch (exit 0); tenantvm destroy; edu back on no driver
# limit: 420
. "$NH_LIB"
need_kvm
need_edu
need_modules vhost_vsock dm_crypt loop
need_tenant_cgroups
unbind_vfio "$edu"
trap 'unbind_vfio "$edu"' EXIT
group="$(iommu_group "$edu")"

work="$NH_WORK"
mkdir -p "$work/img/linux" "$work/state"
for f in "$NH_GUEST_IMAGE"/*; do
    [ -f "$f" ] && cp "$f" "$work/img/linux/"
done
cat >"$work/sim-host.json" <<EOF
{"comment": "SIMULATED: one whole-only GPU at the address of QEMU's edu device",
 "gpus": [{"index": 0, "model": "l40s", "pci_address": "$edu", "driver": "550.54.15",
           "vgpu": "none", "iommu_group": $group}]}
EOF
sock="$work/state/tenantvmd.sock"
TENANTVMD_KEK_FILE="$work/host-kek" TENANTVMD_KEYSLOT_COST=test RUST_LOG=info \
    "$NH_BIN/tenantvmd" --state-dir "$work/state" --socket "$sock" --backend vmm \
    --image-dir "$work/img" --vmm-binary "$NH_BIN/tenantvm-vmm" \
    --gpu-backend "sim:$work/sim-host.json" --gpu-sysfs-root / \
    --boot-timeout-s 300 --agent-timeout-s 600 --stop-grace-s 60 \
    --host-reserved-memory-mib 256 --vcpu-overcommit 8 \
    </dev/null >"$work/daemon.log" 2>&1 &
daemon=$!
trap 'kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; unbind_vfio "$edu"' EXIT
i=0
until [ -S "$sock" ] && [ -f "$work/state/admin.token" ]; do
    i=$((i + 1))
    [ "$i" -lt 600 ] || fail "tenantvmd did not start: $(tail -n 5 "$work/daemon.log" | tr '\n' ' ')"
    kill -0 "$daemon" 2>/dev/null || fail "tenantvmd exited: $(tail -n 5 "$work/daemon.log" | tr '\n' ' ')"
    sleep 0.1
done
step "tenantvmd up"
tvm() { "$NH_BIN/tenantvm" --socket "$sock" --token-file "$work/state/admin.token" "$@"; }
daemon_tail() { tail -n 20 "$work/daemon.log" | tr '\n' ' '; }

cat >"$work/tenant.toml" <<EOF
name = "nh-gpuinfo"
vcpus = 1
memory_mib = 512
disk_gib = 1
gpu = { whole_gpu = true }
[image]
name = "linux"
EOF
tvm create "$work/tenant.toml" --token-out "$work/tenant.token" --timeout-s 400 \
    || fail "tenantvm create failed: $(daemon_tail)"
step "tenant running with edu ($(readlink "/sys/bus/pci/devices/$edu/driver" | sed 's,.*/,,'))"

# The tenant's own token reads its guest's view.
tvmt() { "$NH_BIN/tenantvm" --socket "$sock" --token-file "$work/tenant.token" "$@"; }
tvmt gpu-info nh-gpuinfo >"$work/gpu-info.txt" 2>&1
rc=$?
cat "$work/gpu-info.txt"
[ "$rc" = 0 ] || fail "tenantvm gpu-info exited $rc: $(grep -m 1 MISMATCH "$work/gpu-info.txt")"
grep -q "host devices: $edu" "$work/gpu-info.txt" || fail "gpu-info does not name $edu as handed over"
grep -q "guest ids:    1234:11e8" "$work/gpu-info.txt" || fail "gpu-info does not expect 1234:11e8"
grep -Eq '^  [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7] +1234:11e8 ' "$work/gpu-info.txt" \
    || fail "the guest's agent does not list edu (1234:11e8) among its PCI functions"
grep -q "GUEST NVIDIA-SMI: not in the image" "$work/gpu-info.txt" || fail "nvidia-smi not reported absent"
tvmt gpu-info nh-gpuinfo --json >"$work/gpu-info.json" || fail "gpu-info --json failed"
grep -q '"matches": true' "$work/gpu-info.json" || fail "gpu-info --json does not say matches"
step "gpu-info: the guest sees edu; no mismatch"

tvm destroy nh-gpuinfo --timeout-s 400 || fail "tenantvm destroy failed: $(daemon_tail)"
[ ! -e "/sys/bus/pci/devices/$edu/driver" ] || fail "edu still bound after destroy"
step "destroyed; edu on no driver"
