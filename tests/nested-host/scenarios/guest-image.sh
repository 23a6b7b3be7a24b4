#!/bin/sh
# description: the product's guest image under tenantvm-vmm with a LUKS2 disk made by the
#   orchestrator's disk code and vsock: the agent client gets status, a wrong key is
#   refused, the disk unlocks and mounts, the payload starts and completes a prompt, the
#   guest shuts down cleanly (exit 0), and the host image holds no plaintext
# limit: 600
# sets: ci
. "$NH_LIB"
need_kvm
run_or_fail "$NH_BIN/nh-guest-image"
