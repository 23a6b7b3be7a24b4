#!/bin/sh
# description: benchmark (scripts/bench.sh): the guest image under tenantvm-vmm from the
#   VMM's start to the agent's first status answer over vsock
# limit: 600
# sets: bench
. "$NH_LIB"
need_kvm
run_or_fail "$NH_BIN/nh-guest-image" --ready-only
