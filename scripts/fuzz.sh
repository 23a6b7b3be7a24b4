#!/usr/bin/env bash
# Builds (default) or briefly runs the cargo-fuzz targets of tenantvm-devices
# (vmm/devices/fuzz: block request parsing, vsock packet parsing, what a VFIO device reports).
#
# usage: scripts/fuzz.sh [build | run SECONDS]
# Needs a nightly toolchain and cargo-fuzz; without them it says so and exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../vmm/devices/fuzz"

if ! cargo +nightly --version >/dev/null 2>&1 || ! cargo fuzz --help >/dev/null 2>&1; then
    echo "fuzz: skipped: needs a nightly toolchain and cargo-fuzz" \
        "(rustup toolchain install nightly; cargo install cargo-fuzz)"
    exit 0
fi

case "${1:-build}" in
    build)
        cargo +nightly fuzz build
        ;;
    run)
        secs="${2:-60}"
        for target in block_request vsock_packet vfio_device; do
            cargo +nightly fuzz run "$target" -- -max_total_time="$secs"
        done
        ;;
    *)
        echo "usage: $0 [build | run SECONDS]" >&2
        exit 2
        ;;
esac
