#!/usr/bin/env bash
# Disk benchmark: LUKS2 creation time (production and test keyslot costs), the key check a guest
# pays at open, and crypto-shred time for a 10 GiB sparse image.
#   scripts/bench-disk.sh                  # release build
#   PROFILE=dev scripts/bench-disk.sh      # skip the release build (the timed work is in
#                                          # libcryptsetup and in crates built optimised anyway)
#   TENANTVM_BENCH_DIR=/srv scripts/bench-disk.sh   # benchmark another filesystem
# Needs root (libcryptsetup locks memory) and libcryptsetup (scripts/setup.sh installs it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
exec cargo bench -p tenantvm --bench disk --profile "${PROFILE:-release}"
