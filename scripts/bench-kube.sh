#!/usr/bin/env bash
# The Kubernetes tier's figures (docs/kubernetes.md, docs/benchmarks.md "Kubernetes"): 100
# Tenants across 5 simulated hosts (tenantvmd + node agent each, idle test guests on KVM,
# four simulated H100s each) against a real API server (scripts/kube-apiserver.sh): apply to
# all Running and delete to all gone, against the same tenants made and destroyed straight
# through each host's admin API in the same run; API requests; the operator's memory; GPUs
# used against the planner run once over the whole set. A benchmark, not a test: nothing
# fails on a slow run. Needs root and /dev/kvm. Debug builds (the tests' builds).
#
# usage: scripts/bench-kube.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/kube-apiserver.sh build >/dev/null
nice cargo build -p tenantvm -p tenantvm-jail -p tenantvm-vmm -p tenantvm-kube --bins
nice cargo bench -p tenantvm-kube --bench kube --profile dev
