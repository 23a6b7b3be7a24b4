#!/usr/bin/env bash
# Benchmarks the control plane with a real tenantvmd (release build) running the idle test
# guest under tenantvm-vmm on KVM: create-to-running and destroy latency for 1 tenant and
# for 20 created at once, tenants brought up per second, daemon RSS at 20 tenants, and the
# destroy of a tenant whose VMM was SIGSTOPped (wedged), on tenantvm-vmm and on QEMU TCG
# (a second daemon with --backend qemu-tcg and the no_std test guest; skipped, with a
# line saying so, until scripts/build-test-guests.sh has run). Goal: under 15 s each.
#
# usage: scripts/bench-orchestrator.sh            (as root, with /dev/kvm)
#   TENANTVM_BENCH_ROUNDS=N   single-tenant rounds (default 5)
#   TENANTVM_BENCH_TENANTS=N  tenants created at once (default 20)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The benchmark's daemon finds tenantvm-vmm and tenantvm-jail next to itself.
cargo build -q --release -p tenantvm-vmm -p tenantvm --bins
cargo bench -q -p tenantvm --bench orchestrator
