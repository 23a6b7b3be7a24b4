#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the VMM's tests against real KVM with the in-tree
# test guests, and the orchestrator's end-to-end tests. Tests that need hardware this
# machine lacks (a GPU, an IOMMU, /dev/kvm, root) skip with a printed reason.
#
# usage: scripts/test.sh [extra cargo test arguments]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The no_std test guests are their own workspace (own target, own profiles).
if [ -x scripts/build-test-guests.sh ]; then
    scripts/build-test-guests.sh
    # The guests' parsers (boot info, MP table, memory spans) have host unit tests.
    (cd tests/guests && cargo test --quiet --target "$(rustc -vV | sed -n 's/^host: //p')")
fi

# Build the binaries the integration tests launch, then run everything. The test-hooks
# feature gives tenantvmd the crash hook the crash-safety tests use (never in a release).
cargo build --workspace --bins --features tenantvm/test-hooks
cargo test --workspace --features tenantvm/test-hooks "$@"
