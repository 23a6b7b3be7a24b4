#!/usr/bin/env bash
# Runs scenarios on the nested test host: a QEMU TCG guest with KVM (AMD SVM, nested paging),
# an emulated IOMMU, vfio, vhost-vsock and dm-crypt, booted once for all the scenarios named
# (docs/testing.md). With no scenario, lists them.
#
# Prints `PASS name (seconds)`, `SKIP name: reason` or `FAIL name: reason` (with the outer
# guest's last console lines) per scenario; exits non-zero if any failed.
#
# usage: scripts/nested-host.sh [--release] [nested-host run options] [SCENARIO|@SET...]
#        scripts/nested-host.sh                  list the scenarios
#        scripts/nested-host.sh @ci              the set the test command runs
#        scripts/nested-host.sh stock-kernel vfio-kernel
#   --release   the outer root holds release builds (default: debug, the test command's)
#   other options (--vcpus, --memory-mib, --format ext4|initramfs, --json, ...): see
#   `target/debug/nested-host run --help`
# env:   TENANTVM_HOST=real runs the scenarios on this host (root, KVM, an IOMMU) instead
#        TENANTVM_GUEST_IMAGE: a prebuilt guest image set to use as is
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

profile=debug
args=()
for a in "$@"; do
    case "$a" in
        --release) profile=release ;;
        *) args+=("$a") ;;
    esac
done
cargo build --quiet -p tenantvm-nested-host --bin nested-host
if [ "${#args[@]}" -eq 0 ]; then
    exec target/debug/nested-host list
fi
# Check the names before the build takes minutes.
target/debug/nested-host run --check-names "${args[@]}"
tests/nested-host/prepare.sh --profile "$profile"
exec target/debug/nested-host run --inputs "target/nested-host/$profile/inputs" "${args[@]}"
