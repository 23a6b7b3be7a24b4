#!/usr/bin/env bash
# Guest-image benchmarks: image build time (guest-image/build.sh, Rust binaries already
# compiled) and boot-to-ready under QEMU software emulation (KVM too with --kvm, on a
# host with hardware virtualisation).
#
# usage: guest-image/bench.sh [RUNS] [--kvm]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-3}"
out="$root/target/guest-image-bench"

# Warm-up: compiles the binaries if needed.
"$root/guest-image/build.sh" "$out" >/dev/null 2>&1
start=$(date +%s.%N)
"$root/guest-image/build.sh" "$out" 2>/dev/null
end=$(date +%s.%N)
echo "image build (binaries compiled): $(awk "BEGIN {printf \"%.1f\", $end - $start}") s"
cargo run --quiet --release --manifest-path "$root/Cargo.toml" -p tenantvm-agent \
    --example boot_to_ready -- "$out" "$runs" "${@:2}"
