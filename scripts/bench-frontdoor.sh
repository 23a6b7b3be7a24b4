#!/usr/bin/env bash
# Benchmarks the front door (orchestrator/benches/frontdoor.rs): time to first token and
# tokens per second of a streamed completion through tenantvmd's TLS front door against
# the n-gram payload reached directly, and 10 tenants x their concurrency at once (p99 per
# tenant), and a legitimate client's requests on a quiet door against the same client's while
# 1,100 hostile connections hold and reconnect (success rate, p50/p99 and their ratio).
# Release builds; needs root and /dev/kvm (a real tenantvmd runs the idle guest).
#
# usage: scripts/bench-frontdoor.sh
#   TENANTVM_BENCH_ROUNDS=N    alternating direct/front-door rounds (default 40)
#   TENANTVM_BENCH_REQUESTS=N  requests per stream in the load part (default 10)
#   TENANTVM_BENCH_TOKENS=N    max_tokens per completion (default 128)
#   TENANTVM_BENCH_FLOOD_REQUESTS=N  requests of the legitimate client, quiet and flooded (default 200)
#   TENANTVM_BENCH_DEBUG=1     print when each answer's head and first chunk arrived
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build -q --release -p tenantvm-vmm -p tenantvm -p tenantvm-jail --bins -p tenantvm-ngram
cargo bench -q -p tenantvm --bench frontdoor
