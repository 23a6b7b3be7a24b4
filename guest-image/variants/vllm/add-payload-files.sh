#!/usr/bin/env bash
# Puts the vLLM variant's payload contract into an operator-built vLLM root file system
# (docs/guest-image.md, "GPU hosts: vLLM"): the payload command (/serve.sh), the pages it
# serves until a model is pushed (/no-model: /health, /v1/models), and the mount points the
# agent uses (/data, /tmp, /proc, /sys, /dev). Then build the image set with
#   guest-image/build.sh --payload-dir ROOT --payload-config guest-image/variants/vllm/payload.json OUT
#
# usage: guest-image/variants/vllm/add-payload-files.sh ROOT
#   ROOT  the unpacked vLLM root (e.g. vllm/vllm-openai unpacked with umoci), with the NVIDIA
#         guest driver's user-space libraries added
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { printf 'vllm variant: error: %s\n' "$*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: add-payload-files.sh ROOT (the unpacked vLLM root file system)"
root="$1"
[ -d "$root" ] || die "$root is not a directory"
[ -e "$root/bin/sh" ] || [ -L "$root/bin/sh" ] || die "$root has no /bin/sh: is it a root file system?"
[ -n "$(find "$root/usr/lib" "$root/usr/local/lib" -maxdepth 3 -type d -path '*/python3*/*-packages/vllm' 2>/dev/null | head -1)" ] ||
    die "$root holds no vllm Python package (site-packages/vllm)"
install -m 0755 "$here/serve.sh" "$root/serve.sh"
mkdir -p "$root/no-model/v1" "$root/data" "$root/tmp" "$root/proc" "$root/sys" "$root/dev"
printf '{"status":"no model pushed"}\n' >"$root/no-model/health"
printf '{"object":"list","data":[]}\n' >"$root/no-model/v1/models"
echo "vllm variant: payload files added to $root" >&2
