#!/usr/bin/env bash
# The first thing to run on a real GPU host: every GPU route the product has, in one pass
# of the gated hardware tests (each skips with a printed reason unless its variable names
# the hardware), then `tenantvm host check` and the scrub benchmark; one Markdown table at
# the end, to paste into the docs (docs/gpu.md "Hardware checks"). Without an NVIDIA GPU it
# says so and exits 0.
#
# What runs, per route (the variables are derived from the host unless set; set one to
# `none` to leave its route out):
#   inventory     NVML's profiles against the database; planning and placing on the live host
#   MIG           a 1g GPU instance created, checked, destroyed (when MIG is on)
#   whole card    the GPU's IOMMU group bound to vfio-pci, reset (checked, timed), rebound
#                 (TENANTVM_TEST_VFIO_GPU, default: the GPU's address when no process uses
#                 it); then through tenantvmd: a tenant gets it whole under tenantvm-vmm and
#                 its guest's agent sees its real ids (TENANTVM_TEST_VFIO_DEVICE)
#   vGPU (SR-IOV) MIG on, VFs on, a 1g instance, a typed VF checked, all undone
#                 (TENANTVM_TEST_VGPU, default: the GPU when NVIDIA's vGPU manager is loaded
#                 and it has SR-IOV)
#   mdev vGPU     no hardware test yet (a row says so)
#   guest         nvidia-smi in a tenant's guest sees exactly its slice, whole and (MIG on)
#                 a 1g slice (needs TENANTVM_TEST_GPU_IMAGE); the agent's GPU loads
#   departure     the scrub zeroes residue; the scrub's bandwidth (goal: half the peak)
#
# The builds come first and do not count; the checks then have GPU_CHECK_BUDGET_S seconds
# (default 540: the pass stays under 10 minutes) and each at most GPU_CHECK_TIMEOUT_S
# (default 240); what the budget leaves out is a SKIP row saying so.
#
# usage: scripts/gpu-host-check.sh [--dry-run]   (as root: the routes write sysfs)
#   --dry-run   discover nothing and run nothing: print the table of what would run, with
#               each check's command (works without a GPU; checks this script)
# env:   TENANTVM_TEST_GPU          NVML index (default 0)
#        TENANTVM_TEST_MIG_CREATE   1 to create/destroy a 1g instance (default: 1 when MIG is on)
#        TENANTVM_TEST_VFIO_GPU     PCI address for the whole-card route (see above)
#        TENANTVM_TEST_VFIO_DEVICE  sysfs path for the whole-card tenant (default: that GPU's)
#        TENANTVM_TEST_VGPU         NVML index for the vGPU route (see above)
#        TENANTVM_TEST_GPU_IMAGE    image set with NVIDIA's guest driver and nvidia-smi
#        TENANTVM_TEST_GPU_SLICE    the guest check's first slice (default whole)
#        SCRUB_MAX_BYTES            bytes the scrub benchmark zeroes (default: all it can get)
#        GPU_CHECK_BUDGET_S, GPU_CHECK_TIMEOUT_S, CARGO (default cargo)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo="${CARGO:-cargo}"
dry=0
case "${1:-}" in
    --dry-run) dry=1 ;;
    "") ;;
    *) echo "usage: scripts/gpu-host-check.sh [--dry-run]" >&2; exit 2 ;;
esac
budget="${GPU_CHECK_BUDGET_S:-540}"
per_check="${GPU_CHECK_TIMEOUT_S:-240}"
log="$(mktemp -d /tmp/gpu-host-check.XXXXXX)"
rows=()
header=""

# One table row: RESULT ROUTE CHECK SECONDS DETAIL (no `|` in the detail).
row() { rows+=("| $1 | $2 | $3 | $4 | ${5//|//} |"); }

finish() {
    echo
    echo "gpu-host-check ($(hostname), $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$dry" = 1 ] && echo ', DRY RUN: nothing ran'))${header:+: $header}"
    echo
    echo "| result | route | check | s | detail |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "logs: $log"
    if printf '%s\n' "${rows[@]}" | grep -q '^| FAIL '; then exit 1; fi
    exit 0
}

# The GPU and what its routes need, from nvidia-smi and sysfs.
gpu_index="${TENANTVM_TEST_GPU:-0}"
if [ "$dry" = 1 ]; then
    addr="0000:41:00.0" mig="Enabled" busy=0 vgpu_manager=1 sriov=16
    header="GPU $gpu_index (dry run: an example H100 with MIG on and NVIDIA's vGPU manager)"
else
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        row SKIP all "every GPU check" - "nvidia-smi not found: no NVIDIA driver on this host"
        finish
    fi
    if [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" -eq 0 ]; then
        row SKIP all "every GPU check" - "nvidia-smi lists no GPU"
        finish
    fi
    q() { nvidia-smi --query-gpu="$1" --format=csv,noheader -i "$gpu_index" 2>/dev/null | head -n 1; }
    bus="$(q pci.bus_id)"
    addr="$(printf '%s' "${bus: -12}" | tr 'A-F' 'a-f')"
    mig="$(q mig.mode.current)"
    busy="$(nvidia-smi --query-compute-apps=pid --format=csv,noheader -i "$gpu_index" 2>/dev/null | grep -c .)"
    vgpu_manager=0
    [ -d /sys/module/nvidia_vgpu_vfio ] && vgpu_manager=1
    sriov="$(cat "/sys/bus/pci/devices/$addr/sriov_totalvfs" 2>/dev/null || echo 0)"
    header="GPU $gpu_index $(q name) at $addr, driver $(q driver_version), MIG ${mig:-n/a}, ${sriov:-0} SR-IOV VFs, vGPU manager $([ "$vgpu_manager" = 1 ] && echo loaded || echo absent)"
fi
export TENANTVM_TEST_GPU="$gpu_index"
# A route variable: the caller's value (none: left out), else the derived one.
derive() { # NAME VALUE-OR-EMPTY
    local cur="${!1:-}"
    if [ "$cur" = none ]; then unset "$1"; return; fi
    [ -n "$cur" ] && return
    if [ -n "$2" ]; then export "$1=$2"; else unset "$1"; fi
}
derive TENANTVM_TEST_MIG_CREATE "$([ "$mig" = Enabled ] && echo 1)"
derive TENANTVM_TEST_VFIO_GPU "$([ "$busy" = 0 ] && echo "$addr")"
derive TENANTVM_TEST_VFIO_DEVICE "$([ -n "${TENANTVM_TEST_VFIO_GPU:-}" ] && echo "/sys/bus/pci/devices/$TENANTVM_TEST_VFIO_GPU")"
derive TENANTVM_TEST_VGPU "$([ "$vgpu_manager" = 1 ] && [ "${sriov:-0}" -gt 0 ] && echo "$gpu_index")"
busy_note=""
[ "$busy" != 0 ] && busy_note=" ($busy processes use the GPU: the whole-card route was left out)"

# The builds (not part of the budget).
build() { # WHAT ARGS...
    if [ "$dry" = 1 ]; then return 0; fi
    local what="$1"; shift
    if ! "$cargo" "$@" >"$log/build-$what.log" 2>&1; then
        row FAIL build "$what" - "cargo $* failed: see $log/build-$what.log"
        return 1
    fi
}
started_build=$(date +%s)
build gpu-tests test --no-run -p tenantvm-gpu
build orchestrator-tests test --no-run -p tenantvm --lib --test e2e_gpu_info
build agent-tests test --no-run -p tenantvm-agent --test cuda_fake
build tenantvm build --release -p tenantvm --bin tenantvm
# The guest image the whole-card tenant boots (the tests reuse target/guest-image-test).
if [ "$dry" = 0 ] && [ -z "${TENANTVM_GUEST_IMAGE:-}" ] && [ ! -f target/guest-image-test/manifest.json ]; then
    SOURCE_DATE_EPOCH=1700000000 guest-image/build.sh target/guest-image-test >"$log/build-image.log" 2>&1 ||
        row FAIL build "guest image" - "guest-image/build.sh failed: see $log/build-image.log"
fi
[ "$dry" = 1 ] || echo "builds: $(( $(date +%s) - started_build )) s"
checks_started=$(date +%s)
vars="$(env | grep -E '^TENANTVM_TEST_(GPU|MIG_CREATE|VFIO_GPU|VFIO_DEVICE|VGPU|GPU_IMAGE|GPU_SLICE)=' | sort | tr '\n' ' ')"
header="$header; route variables: ${vars:-none}"

# One check: ROUTE NAME [VAR=VALUE...] -- CARGO-TEST-ARGS. PASS, FAIL, or SKIP with the
# reason its tests printed; SKIP without running once the budget is spent.
check() {
    local route="$1" name="$2"; shift 2
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    local cmd=(env "${envs[@]}" "$cargo" test "$@" -- --nocapture --test-threads=1)
    if [ "$dry" = 1 ]; then
        row DRY "$route" "$name" - "\`${cmd[*]}\`"
        return
    fi
    local spent=$(( $(date +%s) - checks_started ))
    if [ "$spent" -ge "$budget" ]; then
        row SKIP "$route" "$name" - "the ${budget} s budget was spent before it"
        return
    fi
    local out="$log/$(echo "$name" | tr -c 'a-zA-Z0-9' '-').log"
    local t0 rc secs
    t0=$(date +%s)
    timeout "$per_check" "${cmd[@]}" >"$out" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    local skips ran
    skips="$(grep -c '^SKIP ' "$out")"
    ran="$(grep -Eo '[0-9]+ passed' "$out" | awk '{s+=$1} END {print s+0}')"
    if [ "$rc" = 124 ]; then
        row FAIL "$route" "$name" "$secs" "timed out after $per_check s: $out"
    elif [ "$rc" != 0 ]; then
        row FAIL "$route" "$name" "$secs" "$(grep -m 1 -E 'panicked|FAILED|error' "$out" | cut -c1-160) ($out)"
    elif [ "$skips" -gt 0 ] && [ "$skips" -ge "$ran" ]; then
        row SKIP "$route" "$name" "$secs" "$(grep -m 1 '^SKIP ' "$out" | cut -d: -f2- | cut -c2-200)"
    elif [ "$skips" -gt 0 ]; then
        row PASS "$route" "$name" "$secs" "$((ran - skips)) ran, $skips skipped"
    else
        row PASS "$route" "$name" "$secs" "$ran passed$(grep -m 1 -E '^(reset|attached):' "$out" | cut -c1-120 | sed 's/^/; /')"
    fi
}

check inventory "NVML profiles vs the database" -- -p tenantvm-gpu --lib live_gpu_profiles_match_the_database
check inventory "plan on the live host" -- -p tenantvm-gpu --test plan live_host_planning
check inventory "place a 1g tenant" -- -p tenantvm-gpu --test hardware live_host_places_a_1g_tenant
check MIG "1g instance create, overlap, destroy" -- -p tenantvm-gpu --test hardware nvml_create_overlap_and_destroy
check "whole card" "bind to vfio-pci, reset, rebind$busy_note" -- -p tenantvm-gpu --test hardware whole_card_bind_reset_and_rebind
check "whole card" "tenant under tenantvm-vmm sees its ids" -- -p tenantvm --test e2e_gpu_info a_passed_through_device
check "vGPU (SR-IOV)" "MIG on, VFs on, typed VF, undone" -- -p tenantvm-gpu --test hardware mig_backed_vgpu_on_a_real_gpu
row SKIP "vGPU (mdev)" "mdev on a MIG instance" - "no hardware test yet (vGPU 16 and older, A100): FAKE tree only (tenant::device_tests)"
slice="${TENANTVM_TEST_GPU_SLICE:-whole}"
check guest "nvidia-smi sees its slice ($slice)" TENANTVM_TEST_GPU_SLICE="$slice" -- -p tenantvm --test e2e_gpu_info nvidia_smi_in_the_guest_sees_exactly_its_slice
if [ "$mig" = Enabled ] && [ -z "${TENANTVM_TEST_GPU_SLICE:-}" ]; then
    one="$([ "$dry" = 1 ] && echo 1g.10gb || nvidia-smi mig -lgip -i "$gpu_index" 2>/dev/null | grep -o 'MIG 1g\.[0-9]*gb ' | head -n 1 | cut -c5- | tr -d ' ')"
    if [ -n "$one" ]; then
        check guest "nvidia-smi sees its slice ($one)" TENANTVM_TEST_GPU_SLICE="$one" -- -p tenantvm --test e2e_gpu_info nvidia_smi_in_the_guest_sees_exactly_its_slice
    fi
fi
check guest "agent GPU loads on the real driver" -- -p tenantvm-agent --test cuda_fake real_driver
check departure "scrub zeroes residue" -- -p tenantvm --lib scrub_zeroes_residue

# tenantvm host check and the scrub benchmark (zeroing bandwidth against the device's
# memory bandwidth; goal: at least half).
if [ "$dry" = 1 ]; then
    row DRY host "tenantvm host check" - "\`target/release/tenantvm host check\`"
    row DRY departure "scrub bandwidth" - "\`target/release/tenantvm gpu scrub-device --device $gpu_index --verify sampled --json\`"
    finish
fi
t0=$(date +%s)
if target/release/tenantvm host check >"$log/host-check.txt" 2>&1; then
    row PASS host "tenantvm host check" $(( $(date +%s) - t0 )) "$(grep -c '^WARN' "$log/host-check.txt") warnings ($log/host-check.txt)"
else
    row FAIL host "tenantvm host check" $(( $(date +%s) - t0 )) "$(grep -c '^FAIL' "$log/host-check.txt") failures ($log/host-check.txt)"
fi
bench="$log/scrub-bench.json"
args=(gpu scrub-device --device "$gpu_index" --verify sampled --json)
[ -n "${SCRUB_MAX_BYTES:-}" ] && args+=(--max-bytes "$SCRUB_MAX_BYTES")
t0=$(date +%s)
if timeout "$per_check" target/release/tenantvm "${args[@]}" >"$bench" 2>"$log/scrub-bench.err"; then
    line="$(python3 - "$bench" <<'EOF'
import json, sys
o = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
peak = o.get("peak_gbps")
frac = f", {o['zero_gbps'] / peak:.0%} of the {peak:.0f} GB/s peak" if peak else ""
ok = "PASS" if o["passed"] and (not peak or o["zero_gbps"] >= peak / 2) else "FAIL"
print(f"{ok} {o['zero_gbps']:.0f} GB/s over {o['scrubbed_bytes'] / 2**30:.1f} GiB{frac}"
      f" (goal: half), verified {o['verified_bytes'] / 2**30:.1f} GiB, passed={o['passed']}")
EOF
)"
    row "${line%% *}" departure "scrub bandwidth" $(( $(date +%s) - t0 )) "${line#* }"
else
    row FAIL departure "scrub bandwidth" $(( $(date +%s) - t0 )) "see $log/scrub-bench.err"
fi
finish
