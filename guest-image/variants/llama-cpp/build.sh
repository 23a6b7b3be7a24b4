#!/usr/bin/env bash
# Builds the llama.cpp guest-image variant: the product's guest image (guest-image/build.sh)
# with llama.cpp's OpenAI-compatible server as the payload instead of the CI n-gram server,
# its CUDA backend and the NVIDIA guest driver's user-space libraries, all from Debian
# packages (mmdebstrap), never from a source build. Needs network access to a Debian mirror
# and root (or mmdebstrap's unshare mode); it is not run in CI (see docs/guest-image.md,
# "A real serving stack").
#
# usage: guest-image/variants/llama-cpp/build.sh [OUT_DIR]
#        OUT_DIR defaults to .cache/guest-image-llama-cpp
# env:   LLAMA_SUITE     Debian suite with llama.cpp and ggml's CUDA backend (default sid)
#        LLAMA_MIRROR    mirror (default http://deb.debian.org/debian)
#        LLAMA_PACKAGES  packages (default: llama.cpp libggml0-backend-cuda libcuda1
#                        libnvidia-ptxjitcompiler1); the guest driver's libraries must match
#                        the host's driver version: pin them here (pkg=VERSION)
# The guest driver's kernel half (nvidia.ko, nvidia-uvm.ko for the kernel in .cache/kernel,
# matching the host's driver) is the operator's to add: docs/guest-image.md, step 2 of the
# GPU recipe.
# The model is not in the image: push a GGUF file with `tenantvm model push TENANT FILE
# --name NAME`, then stop and start the tenant; serve.sh serves it as NAME.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${1:-$root/.cache/guest-image-llama-cpp}"
suite="${LLAMA_SUITE:-sid}"
mirror="${LLAMA_MIRROR:-http://deb.debian.org/debian}"
packages="${LLAMA_PACKAGES:-llama.cpp libggml0-backend-cuda libcuda1 libnvidia-ptxjitcompiler1}"

say() { printf '\033[1mllama-cpp variant:\033[0m %s\n' "$*" >&2; }
die() { printf 'llama-cpp variant: error: %s\n' "$*" >&2; exit 1; }
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: apt-get install mmdebstrap"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
payload="$work/payload"

say "installing $packages from $suite into the payload root"
# minbase + the packages; no recommends (the image stays as small as the engine allows);
# apt's lists, caches and docs are dropped.
mmdebstrap --variant=minbase --components=main,contrib,non-free,non-free-firmware \
    --include="${packages// /,}" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$suite" "$payload" "$mirror"
[ -x "$payload/usr/bin/llama-server" ] || die "the packages gave no /usr/bin/llama-server (set LLAMA_PACKAGES)"
install -m 0755 "$here/serve.sh" "$payload/serve.sh"
# What serve.sh answers before a model is pushed (busybox httpd, static files).
mkdir -p "$payload/no-model/v1"
printf '{"status":"no model pushed"}\n' >"$payload/no-model/health"
printf '{"object":"list","data":[]}\n' >"$payload/no-model/v1/models"

say "building the image set into $out"
"$root/guest-image/build.sh" --payload-dir "$payload" --payload-config "$here/payload.json" "$out"
say "done: push a GGUF model with tenantvm model push, then stop and start the tenant"
