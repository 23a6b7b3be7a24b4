#!/bin/sh
# description: the no_std test guests' KVM suite (vmm/tests/guest_*.rs: boot paths, smp,
#   RAM pattern, serial, reset and exit statuses, control socket, seccomp, virtio-blk,
#   vsock, rng, MSI-X, hostile modes) run as built, on this host's KVM: inside the outer
#   guest that is AMD SVM with nested paging
# limit: 600
# sets: ci
. "$NH_LIB"
need_kvm
# The test binaries name the VMM by its build path (the outer root keeps it there) and find
# the test guests here; their skips are collected (tenantvm-skip) and listed.
export TENANTVM_TEST_GUESTS="$NH_TEST_GUESTS" TENANTVM_SKIP_LOG="$NH_WORK/skips"
: >"$TENANTVM_SKIP_LOG"
failed=""
for t in $(cat "$NH_KVM_TESTS_LIST"); do
    name="$(basename "$t" | sed 's/-[0-9a-f]*$//')"
    step "$name"
    (cd "$NH_WORK" && "$t" --quiet) 2>&1 | tee "$NH_WORK/$name.log"
    grep -q '^test result: ok\.' "$NH_WORK/$name.log" || failed="$failed $name"
done
passed="$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' "$NH_WORK"/*.log | awk '{ n += $1 } END { print n + 0 }')"
skipped="$(sort -u "$TENANTVM_SKIP_LOG" | wc -l)"
sort -u "$TENANTVM_SKIP_LOG"
step "$((passed - skipped)) passed, $skipped skipped${failed:+, failed:$failed}"
[ -z "$failed" ] || fail "KVM guest tests failed:$failed"
