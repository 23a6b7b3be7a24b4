#!/usr/bin/env bash
# Builds what the nested host's outer root is made of and writes the list of it to
# target/nested-host/PROFILE/inputs (read by build-rootfs.sh and the harness):
#
#   NH_BIN             target/PROFILE: tenantvm-vmm, tenantvm, tenantvmd, tenantvm-jail and
#                      the scenario programs nh-stock-kernel, nh-guest-image, nh-vfio-kernel
#   NH_GUEST_TOOLS     nh-vsock-echo, static (it runs in an inner guest with no C library)
#   NH_GUEST_IMAGE     the guest image (guest-image/build.sh), or $TENANTVM_GUEST_IMAGE as is
#   NH_TEST_GUESTS     the no_std test guests (scripts/build-test-guests.sh)
#   NH_KVM_TESTS_LIST  a file listing the VMM's KVM test binaries (vmm/tests/guest_*.rs)
#   NH_LLAMA_IMAGE     the llama.cpp engine's image set and
#   NH_LLAMA_MODEL     test model, where guest-image/variants/llama-cpp/prepare.sh built
#                      them into .cache (listed only then: the scenarios that need them skip)
#
# debug (the default, what scripts/test.sh uses) builds the whole workspace, as the test
# command does, so nothing is compiled twice; release builds only what the outer root holds.
#
# usage: tests/nested-host/prepare.sh [--profile debug|release]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
profile=debug
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile="${2:?--profile needs debug or release}"; shift 2 ;;
        *) echo "prepare: unknown argument $1 (usage: prepare.sh [--profile debug|release])" >&2; exit 2 ;;
    esac
done
say() { printf '\033[1mnested-host:\033[0m %s\n' "$*" >&2; }
die() { printf 'nested-host: error: %s\n' "$*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 is missing: run scripts/setup.sh"
[ -f .cache/kernel/vmlinuz ] || [ -n "${TENANTVM_KERNEL_DIR:-}" ] || die "no stock kernel in .cache/kernel: run scripts/setup.sh"

out="$root/target/nested-host/$profile"
mkdir -p "$out"

say "building the binaries ($profile)"
case "$profile" in
    debug)
        # The same features as scripts/test.sh, so the test binaries listed here are the
        # ones its `cargo test` runs (and nothing is built twice).
        cargo build --quiet --workspace --bins --features tenantvm/test-hooks,tenantvm-vmm/test-model-gpu
        tests_json="$(cargo test --quiet --workspace --no-run --features tenantvm/test-hooks,tenantvm-vmm/test-model-gpu --message-format=json 2>/dev/null)" ||
            die "building the workspace's tests failed: run cargo test --workspace --no-run to see why"
        ;;
    release)
        cargo build --quiet --release -p tenantvm-vmm -p tenantvm -p tenantvm-jail -p tenantvm-nested-host
        tests_json="$(cargo test --quiet --release -p tenantvm-vmm --tests --no-run --message-format=json 2>/dev/null)" ||
            die "building the VMM's tests failed: run cargo test --release -p tenantvm-vmm --no-run to see why"
        ;;
    *) die "--profile must be debug or release" ;;
esac
# The VMM's KVM test binaries (vmm/tests/guest_*.rs) that cargo just built.
printf '%s\n' "$tests_json" | python3 -c '
import json, sys
seen = {}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and t.get("kind") == ["test"] and t.get("name", "").startswith("guest_")
            and t.get("src_path", "").endswith("vmm/tests/" + t["name"] + ".rs")):
        seen[t["name"]] = m["executable"]
for name in sorted(seen):
    print(seen[name])
' >"$out/kvm-tests.list"
[ -s "$out/kvm-tests.list" ] || die "found none of the VMM's KVM test binaries in cargo's output"

say "building the static guest tools"
# The same flags as guest-image/build.sh, so the two builds share their dependencies.
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$root=/src" \
    cargo build --quiet --release --locked --target x86_64-unknown-linux-gnu -p tenantvm-nested-guest-tools

scripts/build-test-guests.sh

if [ -n "${TENANTVM_GUEST_IMAGE:-}" ]; then
    image="$TENANTVM_GUEST_IMAGE"
    [ -f "$image/manifest.json" ] || die "TENANTVM_GUEST_IMAGE=$image holds no image: run guest-image/build.sh $image"
else
    image="$root/target/nested-host/guest-image"
    say "building the guest image"
    guest-image/build.sh "$image" 2>&1 | tail -n 1 >&2
fi

cat >"$out/inputs.tmp" <<EOF
NH_PROFILE=$profile
NH_BIN=$root/target/$profile
NH_GUEST_TOOLS=$root/target/x86_64-unknown-linux-gnu/release
NH_GUEST_IMAGE=$image
NH_TEST_GUESTS=$root/target/test-guests
NH_KVM_TESTS_LIST=$out/kvm-tests.list
EOF
llama_image="$root/.cache/guest-image-llama-cpp" llama_model="$root/.cache/llama-cpp/test-model.gguf"
if [ -f "$llama_image/manifest.json" ] && [ -f "$llama_model" ]; then
    printf 'NH_LLAMA_IMAGE=%s\nNH_LLAMA_MODEL=%s\n' "$llama_image" "$llama_model" >>"$out/inputs.tmp"
else
    say "no llama.cpp variant in .cache (guest-image/variants/llama-cpp/prepare.sh): its scenarios will skip"
fi
mv "$out/inputs.tmp" "$out/inputs"
say "inputs ready: $out/inputs ($(wc -l <"$out/kvm-tests.list") KVM test binaries)"
