#!/usr/bin/env bash
# On a real GPU host: runs the gated GPU tests (each skips with a printed reason unless its
# variable names the hardware) and the scrub benchmark, and prints one summary. Without an
# NVIDIA GPU it says so and exits 0 (nothing to check). See docs/gpu.md "Hardware checks".
#
# usage: scripts/gpu-host-check.sh                 (as root for the tests that write sysfs)
# env:   TENANTVM_TEST_GPU          NVML index for the read-only tests and the scrub (default 0)
#        TENANTVM_TEST_MIG_CREATE=1 also create/destroy a 1g MIG instance (MIG must be on)
#        TENANTVM_TEST_VFIO_GPU     PCI address: bind to vfio-pci, reset, rebind (idle GPU)
#        TENANTVM_TEST_VGPU         NVML index: the MIG-backed vGPU route (vGPU manager)
#        TENANTVM_TEST_GPU_IMAGE    image set with the NVIDIA guest driver and nvidia-smi: a
#                                   tenant gets a slice and nvidia-smi in its guest must see
#                                   exactly that slice's memory (tenantvm gpu-info)
#        TENANTVM_TEST_GPU_SLICE    that tenant's request: whole (default) or a MIG profile
#        SCRUB_MAX_BYTES            bytes the scrub benchmark zeroes (default: all it can get)
#        CARGO                      (default cargo)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo="${CARGO:-cargo}"
log="$(mktemp -d /tmp/gpu-host-check.XXXXXX)"
summary=()

note() { summary+=("$(printf '%-6s %-44s %s' "$1" "$2" "$3")"); }

finish() {
    echo
    rmdir "$log" 2>/dev/null || true
    echo "gpu-host-check summary ($(hostname), $(date -u +%Y-%m-%dT%H:%M:%SZ))${log:+$([ -d "$log" ] && echo "; logs in $log")}"
    printf '%s\n' "${summary[@]}"
    if printf '%s\n' "${summary[@]}" | grep -q '^FAIL'; then exit 1; fi
    exit 0
}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    note SKIP "all GPU checks" "nvidia-smi not found: no NVIDIA driver on this host"
    finish
fi
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
if [ "${gpus:-0}" -eq 0 ]; then
    note SKIP "all GPU checks" "nvidia-smi lists no GPU"
    finish
fi
export TENANTVM_TEST_GPU="${TENANTVM_TEST_GPU:-0}"
nvidia-smi -L | sed 's/^/  /'
echo "  driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader -i "$TENANTVM_TEST_GPU")"

# One cargo test command: PASS, FAIL, or SKIP with the reasons its tests printed.
run_test() {
    local name="$1"; shift
    local out="$log/$name.log"
    if "$cargo" test "$@" -- --nocapture --test-threads=1 >"$out" 2>&1; then
        local skips
        skips="$(grep -c '^SKIP ' "$out" || true)"
        local ran
        ran="$(grep -Eo '[0-9]+ passed' "$out" | awk '{s+=$1} END {print s+0}')"
        if [ "${skips:-0}" -gt 0 ] && [ "$skips" -ge "$ran" ]; then
            note SKIP "$name" "$(grep '^SKIP ' "$out" | head -1 | cut -c6-)"
        elif [ "${skips:-0}" -gt 0 ]; then
            note PASS "$name" "$((ran - skips)) ran, $skips skipped ($(grep '^SKIP ' "$out" | cut -d: -f1 | cut -c6- | paste -sd, -))"
        else
            note PASS "$name" "$ran passed"
        fi
    else
        note FAIL "$name" "see $out"
    fi
}

run_test "database vs NVML profiles" -p tenantvm-gpu --lib live_gpu_profiles_match_the_database
run_test "plan on the live host" -p tenantvm-gpu --test plan live_host_planning
run_test "gpu hardware tests" -p tenantvm-gpu --test hardware
run_test "scrub zeroes residue" -p tenantvm --lib scrub_zeroes_residue
run_test "agent GPU loads on the real driver" -p tenantvm-agent --test cuda_fake real_driver
run_test "guest sees its slice (gpu-info)" -p tenantvm --test e2e_gpu_info nvidia_smi_in_the_guest_sees_exactly_its_slice

# The scrub benchmark: zeroing bandwidth as a fraction of the device's memory bandwidth
# (goal: at least half).
bench="$log/scrub-bench.json"
if "$cargo" build --release -p tenantvm --bin tenantvm >"$log/build.log" 2>&1; then
    if target/release/tenantvm host check >"$log/host-check.txt" 2>&1; then
        note PASS "host check" "$(grep -c '^WARN' "$log/host-check.txt") warnings (see $log/host-check.txt)"
    else
        note FAIL "host check" "$(grep -c '^FAIL' "$log/host-check.txt") failures (see $log/host-check.txt)"
    fi
    args=(gpu scrub-device --device "$TENANTVM_TEST_GPU" --verify sampled --json)
    [ -n "${SCRUB_MAX_BYTES:-}" ] && args+=(--max-bytes "$SCRUB_MAX_BYTES")
    if target/release/tenantvm "${args[@]}" >"$bench" 2>"$log/scrub-bench.err"; then
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
        note "${line%% *}" "scrub bandwidth" "${line#* }"
    else
        note FAIL "scrub bandwidth" "see $log/scrub-bench.err"
    fi
else
    note FAIL "scrub bandwidth" "tenantvm did not build: see $log/build.log"
fi

finish
