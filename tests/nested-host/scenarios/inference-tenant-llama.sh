#!/bin/sh
# description: a real serving engine in a tenant on tenantvm-vmm: Debian's llama-server
#   (the llama-cpp guest-image variant) through tenantvmd inside the outer guest: create
#   with no model, the generated test GGUF pushed with tenantvm model push and served after
#   tenantvm payload restart, over the TLS front door /v1/models, a completion answered by
#   llama-server's Debian build with a usage block the engine counted, a streamed chat
#   completion, a repeated prompt from the engine's prompt cache, the host image scanned for
#   the model's bytes (none; the pushed file as positive control), destroy with a receipt
#   that covers the pushed model
# limit: 900
# needs: llama
# sets: ci
. "$NH_LIB"
[ -n "${NH_LLAMA_IMAGE:-}" ] && [ -n "${NH_LLAMA_MODEL:-}" ] ||
    skip "the llama.cpp variant is not prepared: run guest-image/variants/llama-cpp/prepare.sh, then tests/nested-host/prepare.sh"
need_kvm
need_modules vhost_vsock dm_crypt loop
need_tenant_cgroups
# The front door listens on 127.0.0.1: the outer guest's init leaves loopback down.
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up || fail "cannot bring up loopback"
run_or_fail "$NH_BIN/nh-llama-tenant"
