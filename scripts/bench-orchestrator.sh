#!/usr/bin/env bash
# Benchmarks the control plane with a real tenantvmd (release build) running the idle test
# guest under tenantvm-vmm on KVM: create-to-running and destroy latency for 1 tenant and
# for 20 created at once, tenants brought up per second, daemon RSS at 20 tenants; the
# destroy of a tenant whose VMM was SIGSTOPped (wedged), on tenantvm-vmm and on QEMU TCG
# (a second daemon with --backend qemu-tcg and the no_std test guest; skipped, with a
# line saying so, until scripts/build-test-guests.sh has run; goal: under 15 s each); and
# API latency p50/p99 of one tenant while another tenant has its whole concurrency (16
# inference requests) hung on a guest agent that never answers, against the same with no
# hung tenant (goal: within 10%).
#
# usage: scripts/bench-orchestrator.sh            (as root, with /dev/kvm)
#   TENANTVM_BENCH_ROUNDS=N   single-tenant rounds (default 5)
#   TENANTVM_BENCH_TENANTS=N  tenants created at once (default 20)
#   TENANTVM_BENCH_SAMPLES=N  status requests per latency block (default 300)
#   TENANTVM_BENCH_BLOCKS=N   alternating blocks with and without the hung tenant (default 30)
#   TENANTVM_BENCH_ONLY_ISOLATION=1  only the latency figure
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The benchmark's daemon finds tenantvm-vmm and tenantvm-jail next to itself.
cargo build -q --release -p tenantvm-vmm -p tenantvm -p tenantvm-jail --bins
cargo bench -q -p tenantvm --bench orchestrator
