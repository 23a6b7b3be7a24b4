#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the VMM's tests against real KVM with the in-tree
# test guests, the orchestrator's end-to-end tests, and the nested host's CI scenarios
# (tests/nested-host, docs/testing.md). Tests that need what this machine lacks (a GPU, an
# IOMMU, /dev/kvm, root) skip with `SKIP <test>: <reason>` (tenantvm-skip); the run ends with
#
#   N passed, N failed, N skipped
#
# and the reason for each skip. A skipped test is not counted as passed.
#
# usage: scripts/test.sh [extra cargo test arguments]
# env:   TENANTVM_NESTED=0 leaves out the nested host's preparation (its test then skips)
#        TENANTVM_LLAMA=0 leaves out the llama.cpp engine's preparation (its tests then skip)
#        TENANTVM_KUBE=0 leaves out the Kubernetes API server's build (its test then skips)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

work="$(mktemp -d "${TMPDIR:-/tmp}/tenantvm-test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export TENANTVM_SKIP_LOG="$work/skips"
: >"$TENANTVM_SKIP_LOG"
log="$work/output"

started=$SECONDS
phase() { printf '==== test.sh: %s (%d s in)\n' "$*" "$((SECONDS - started))"; }

# Runs a test command, its output shown and kept for the summary; remembers a failure.
failed_commands=0
run_tests() {
    set +e
    "$@" 2>&1 | tee -a "$log"
    local rc="${PIPESTATUS[0]}"
    set -e
    [ "$rc" -eq 0 ] || failed_commands=$((failed_commands + 1))
}

# The no_std test guests are their own workspace (own target, own profiles).
if [ -x scripts/build-test-guests.sh ]; then
    phase "the test guests"
    scripts/build-test-guests.sh
    # The guests' parsers (boot info, MP table, memory spans) have host unit tests.
    run_tests bash -c 'cd tests/guests && cargo test --quiet --target "$(rustc -vV | sed -n "s/^host: //p")"'
fi

# Build the binaries the integration tests launch and the nested host's inputs (release-less:
# the debug profile the tests already build), then run everything. The test-hooks feature
# gives tenantvmd the crash hook the crash-safety tests use, test-model-gpu gives tenantvm-vmm
# `--device model-gpu` (the model GPU fake); neither is ever in a release build.
phase "the binaries"
cargo build --workspace --bins --features tenantvm/test-hooks,tenantvm-vmm/test-model-gpu
# The llama.cpp engine's variant image, test model and pinned OpenAI client
# (e2e_llama_engine, llama_test_model and the nested host's inference-tenant-llama, so
# before the nested host's inputs, which list them), built into .cache: about 4 minutes the
# first time, seconds when guest-image/ is unchanged since (docs/guest-image.md). Without
# a Debian mirror the preparation fails and those tests say SKIP naming it.
if [ "${TENANTVM_LLAMA:-1}" != 0 ]; then
    phase "the llama.cpp variant"
    run_tests nice guest-image/variants/llama-cpp/prepare.sh
fi
if [ "${TENANTVM_NESTED:-1}" != 0 ]; then
    phase "the nested host's inputs"
    tests/nested-host/prepare.sh --profile debug
    # The guest image it built serves the agent's image tests too.
    TENANTVM_GUEST_IMAGE="${TENANTVM_GUEST_IMAGE:-$(sed -n 's/^NH_GUEST_IMAGE=//p' target/nested-host/debug/inputs)}"
    export TENANTVM_GUEST_IMAGE
fi
# The Kubernetes tier's API server (orchestrator/kube/tests/apiserver.rs, docs/kubernetes.md):
# kube-apiserver 1.20 built from Debian's source package into .cache/kube the first time
# (minutes), found there after; without it that test skips, naming the script.
if [ "${TENANTVM_KUBE:-1}" != 0 ]; then
    phase "the Kubernetes API server"
    scripts/kube-apiserver.sh build >/dev/null ||
        echo "test.sh: the API server did not build; the Kubernetes tier will skip"
fi
phase "cargo test"
run_tests cargo test --workspace --no-fail-fast --features tenantvm/test-hooks,tenantvm-vmm/test-model-gpu "$@"

# The summary: libtest counts a skipped test as passed; the skip log says which ones were.
read -r passed failed < <(awk '/^test result:/ {
        for (i = 1; i <= NF; i++) {
            if ($(i) ~ /^passed;?$/) p += $(i - 1)
            if ($(i) ~ /^failed;?$/) f += $(i - 1)
        }
    } END { print p + 0, f + 0 }' "$log")
ignored="$(awk '/^test result:/ { for (i = 1; i <= NF; i++) if ($(i) ~ /^ignored;?$/) n += $(i - 1) } END { print n + 0 }' "$log")"
sort -u "$TENANTVM_SKIP_LOG" >"$work/skips.unique"
skipped="$(wc -l <"$work/skips.unique")"
phase "done"
echo
echo "$((passed - skipped)) passed, $failed failed, $skipped skipped"
if [ "$skipped" -gt 0 ]; then
    sed 's/^/  /' "$work/skips.unique"
fi
[ "$ignored" -eq 0 ] || echo "($ignored #[ignore] tests not run: helpers that other tests run in a child process)"
if [ "$failed" -gt 0 ] || [ "$failed_commands" -gt 0 ]; then
    echo "FAILED ($failed_commands test commands failed)"
    exit 1
fi
