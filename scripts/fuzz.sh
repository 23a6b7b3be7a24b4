#!/usr/bin/env bash
# Builds (default) or briefly runs the cargo-fuzz targets of tenantvm's guest-facing parsers:
# - tenantvm-devices (vmm/devices/fuzz): block request parsing, vsock packet parsing, what a
#   VFIO device reports;
# - tenantvm-agent-protocol (guest-image/protocol/fuzz): the TVAG frame reader and message
#   decoding (agent_frame), the stream multiplexer's frame decoder (mux_frames).
#
# usage: scripts/fuzz.sh [build | run SECONDS]   (run: SECONDS per target)
# Needs a nightly toolchain and cargo-fuzz; without them it says so and exits 0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Each fuzz crate (its own workspace) and its targets.
crates=(
    "vmm/devices/fuzz:block_request vsock_packet vfio_device"
    "guest-image/protocol/fuzz:agent_frame mux_frames"
)

if ! cargo +nightly --version >/dev/null 2>&1 || ! cargo fuzz --help >/dev/null 2>&1; then
    echo "fuzz: skipped: needs a nightly toolchain and cargo-fuzz" \
        "(rustup toolchain install nightly; cargo install cargo-fuzz)"
    exit 0
fi

case "${1:-build}" in
    build)
        for entry in "${crates[@]}"; do
            (cd "$root/${entry%%:*}" && cargo +nightly fuzz build)
        done
        ;;
    run)
        secs="${2:-60}"
        for entry in "${crates[@]}"; do
            for target in ${entry#*:}; do
                (cd "$root/${entry%%:*}" &&
                    cargo +nightly fuzz run "$target" -- -max_total_time="$secs")
            done
        done
        ;;
    *)
        echo "usage: $0 [build | run SECONDS]" >&2
        exit 2
        ;;
esac
