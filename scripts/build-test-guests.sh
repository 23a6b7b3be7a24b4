#!/usr/bin/env bash
# Builds the no_std test guests (tests/guests, their own Cargo workspace and target dir) and
# packages them into target/test-guests/:
#   tvm-testguest          ELF with the 64-bit entry and a PVH note (QEMU -kernel boots it too)
#   tvm-testguest.nopvh    the same ELF without its PT_NOTE: loaders take the 64-bit ELF entry
#   tvm-testguest.bzImage  the same guest in the bzImage format (64-bit entry at +0x200)
# Fast when nothing changed: cargo's no-op build, and packaging only when the ELF is newer.
#
# usage: scripts/build-test-guests.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/test-guests"
mkdir -p "$out"

if ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-none; then
    echo "build-test-guests: Rust target x86_64-unknown-none missing; run scripts/setup.sh" >&2
    exit 1
fi

# Their own target dir also when CARGO_TARGET_DIR is set (the ELF is read from it below).
(cd "$root/tests/guests" && cargo build --release --quiet --target-dir "$root/tests/guests/target")

elf="$root/tests/guests/target/x86_64-unknown-none/release/tvm-testguest"
pack="$root/tests/guests/pack.py"
if [ ! -f "$out/tvm-testguest" ] || [ "$elf" -nt "$out/tvm-testguest" ] || [ "$pack" -nt "$out/tvm-testguest" ]; then
    python3 "$pack" bzimage "$elf" "$out/tvm-testguest.bzImage"
    python3 "$pack" no-pvh "$elf" "$out/tvm-testguest.nopvh"
    cp "$elf" "$out/tvm-testguest.tmp" && mv "$out/tvm-testguest.tmp" "$out/tvm-testguest"
fi
