#!/usr/bin/env bash
# Builds the llama.cpp guest-image variant: the product's guest image (guest-image/build.sh)
# with llama.cpp's OpenAI-compatible server, llama-server, as Debian ships it
# (llama.cpp-tools) as the payload instead of the CI n-gram server. The engine keeps its
# own root (/payload in the initramfs: Debian's loader, libraries and ggml backends), in
# which the agent confines it as an unprivileged user that sees only the tenant's /data
# (docs/guest-image.md, "A real engine: llama.cpp"). Nothing is compiled and no binary is
# downloaded from anywhere but the Debian archive.
#
# CPU build (default; runs here, in CI): llama.cpp-tools and busybox, unpacked with
# `mmdebstrap --variant=extract` (the packages and their dependencies, no maintainer
# scripts: about 60 MB). CUDA build (--cuda): the same plus ggml's CUDA backend and the
# NVIDIA driver's user-space libraries, installed with --variant=minbase, because the
# driver packages set their libraries up in maintainer scripts; pin the driver libraries
# to the host driver's version in LLAMA_PACKAGES. The guest driver's kernel half (nvidia.ko,
# nvidia-uvm.ko for the kernel in .cache/kernel) is the operator's to add (docs/guest-image.md,
# step 2 of the GPU recipe).
#
# The payload root is cached in .cache/llama-cpp/roots/<key>, the key a hash of the suite,
# mirror, packages, variant and this script, so a rebuild costs only the image build.
# The engine's exact version (llama-server --version, and every package's version) goes
# into the image set's manifest.json under "payload".
#
# usage: guest-image/variants/llama-cpp/build.sh [--cuda] [--ggml-cpu LIST] [OUT_DIR]
#        OUT_DIR defaults to .cache/guest-image-llama-cpp
#        --ggml-cpu LIST  keep only these of ggml's CPU backend variants (comma-separated,
#                         e.g. x64): ggml loads the best one the CPU supports, and QEMU
#                         7.2's TCG runs the AVX2 variants about 14 times slower than the
#                         SSE2 one (x64); scripts and tests that boot the variant under TCG
#                         pass --ggml-cpu x64 (docs/guest-image.md). Default: all.
# env:   LLAMA_SUITE     Debian suite with llama.cpp (default sid; bookworm and trixie lack it)
#        LLAMA_MIRROR    mirror (default http://deb.debian.org/debian)
#        LLAMA_PACKAGES  packages (default: llama.cpp-tools busybox; with --cuda also
#                        libggml0-backend-cuda libcuda1 libnvidia-ptxjitcompiler1 nvidia-smi:
#                        gpu-info and the gated test read GPU memory with it)
#        SOURCE_DATE_EPOCH  as for guest-image/build.sh
# The model is not in the image: push a GGUF file with `tenantvm model push TENANT FILE
# --name NAME`, then `tenantvm payload restart TENANT`; serve.sh serves it as NAME.
set -euo pipefail
umask 022
export LC_ALL=C
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cuda=0 ggml_cpu="" out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cuda) cuda=1; shift ;;
        --ggml-cpu) ggml_cpu="${2:?--ggml-cpu needs a list}"; shift 2 ;;
        -*) echo "llama-cpp variant: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
out="${out:-$root/.cache/guest-image-llama-cpp}"
suite="${LLAMA_SUITE:-sid}"
mirror="${LLAMA_MIRROR:-http://deb.debian.org/debian}"
if [ "$cuda" = 1 ]; then
    packages="${LLAMA_PACKAGES:-llama.cpp-tools busybox libggml0-backend-cuda libcuda1 libnvidia-ptxjitcompiler1 nvidia-smi}"
    variant=minbase
else
    packages="${LLAMA_PACKAGES:-llama.cpp-tools busybox}"
    variant=extract
fi

say() { printf '\033[1mllama-cpp variant:\033[0m %s\n' "$*" >&2; }
die() { printf 'llama-cpp variant: error: %s\n' "$*" >&2; exit 1; }
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: run scripts/setup.sh"
[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap's root mode, chroot for the engine's version)"
start=$(date +%s.%N)

# 1. The engine's root, from the Debian archive (cached by what determines it).
key="$(printf '%s\n' "$suite" "$mirror" "$packages" "$variant" | cat - "$0" | sha256sum | cut -c1-16)"
roots="$root/.cache/llama-cpp/roots"
cached="$roots/$key"
if [ ! -x "$cached/usr/bin/llama-server" ]; then
    say "installing $packages from $suite ($variant) into a payload root"
    mkdir -p "$roots"
    rm -rf "$cached.tmp"
    # The mirror's Release file may be past its Valid-Until (a frozen snapshot): accepted,
    # the signature is still checked.
    mmdebstrap --variant="$variant" --components=main,contrib,non-free,non-free-firmware \
        --include="${packages// /,}" \
        --aptopt='Acquire::Check-Valid-Until "false"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --extract-hook='mkdir -p "$1"/var/lib/tenantvm && ls "$1"/var/cache/apt/archives/ >"$1"/var/lib/tenantvm/debs' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" "$cached.tmp" "$mirror" >&2
    # extract leaves out base-files' merged-/usr links; the loader is /lib64/ld-linux...
    for d in bin sbin lib lib64; do
        [ -e "$cached.tmp/$d" ] || [ -L "$cached.tmp/$d" ] || ln -s "usr/$d" "$cached.tmp/$d"
    done
    # Not needed by a server: documentation, translations, iconv modules.
    rm -rf "$cached.tmp"/usr/share/{doc,man,info,locale,lintian} \
        "$cached.tmp"/usr/lib/x86_64-linux-gnu/gconv
    [ -x "$cached.tmp/usr/bin/llama-server" ] || die "the packages gave no /usr/bin/llama-server (set LLAMA_PACKAGES)"
    mv "$cached.tmp" "$cached"
    # Roots of other keys are stale (another suite, package list or recipe).
    find "$roots" -mindepth 1 -maxdepth 1 ! -name "$key" -exec rm -rf {} +
else
    say "payload root cached in $cached"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
payload="$work/payload"
cp -a "$cached" "$payload"
# mmdebstrap's device nodes stay out of the image: the agent mounts the payload's /dev.
rm -rf "${payload:?}/dev" && mkdir "$payload/dev"

# 2. ggml's CPU variants to keep (see --ggml-cpu).
kept_cpu=()
while read -r so; do
    name="$(basename "$so" .so)"; name="${name#libggml-cpu-}"
    if [ -n "$ggml_cpu" ] && [[ ",$ggml_cpu," != *",$name,"* ]]; then
        rm -f "$so"
    else
        kept_cpu+=("$name")
    fi
done < <(find "$payload/usr" -name 'libggml-cpu-*.so' | sort)
[ "${#kept_cpu[@]}" -gt 0 ] || die "--ggml-cpu $ggml_cpu kept no CPU backend (the root has: $(find "$cached/usr" -name 'libggml-cpu-*.so' -printf '%f ' | sed 's/libggml-cpu-//g; s/\.so//g'))"

# 3. The payload's command and what it answers before a model is pushed (busybox httpd).
install -m 0755 "$here/serve.sh" "$payload/serve.sh"
mkdir -p "$payload/no-model/v1" "$payload/data" "$payload/tmp" "$payload/proc" "$payload/dev" "$payload/sys"
printf '{"status":"no model pushed"}\n' >"$payload/no-model/health"
printf '{"object":"list","data":[]}\n' >"$payload/no-model/v1/models"

# 4. The engine's version, from the engine itself and from the package database.
engine_version="$(chroot "$payload" /usr/bin/llama-server --version 2>&1 | head -1)"
case "$engine_version" in
    version:*) ;;
    *) die "llama-server --version did not answer with a version: $engine_version" ;;
esac
# minbase installs through dpkg (its database says); extract only unpacks, so the archive
# names the extract hook listed say (NAME_VERSION_ARCH.deb, the epoch's colon escaped).
pkgs="$(dpkg-query --admindir="$payload/var/lib/dpkg" -W -f='${Package}=${Version}\n' 2>/dev/null | sort || true)"
if [ -z "$pkgs" ] && [ -f "$payload/var/lib/tenantvm/debs" ]; then
    pkgs="$(sed -n 's/%3a/:/g; s/^\([^_]*\)_\([^_]*\)_[^_]*\.deb$/\1=\2/p' "$payload/var/lib/tenantvm/debs" | sort)"
fi
engine_pkg="$(printf '%s\n' "$pkgs" | grep '^llama.cpp-tools=' || true)"
python3 - "$work/payload-manifest.json" "$engine_version" "$engine_pkg" "$suite" "$mirror" \
    "$variant" "$pkgs" "${kept_cpu[*]}" "$cuda" <<'EOF'
import json, sys
out, version, pkg, suite, mirror, variant, pkgs, cpu, cuda = sys.argv[1:10]
json.dump({
    "engine": {"name": "llama.cpp llama-server", "version": version, "package": pkg},
    "flavour": "cuda" if cuda == "1" else "cpu",
    "suite": suite,
    "mirror": mirror,
    "mmdebstrap_variant": variant,
    "debian_packages": [p for p in pkgs.splitlines() if p],
    "ggml_cpu_variants": cpu.split(),
}, open(out, "w"), indent=2, sort_keys=True)
EOF
say "engine: $engine_version ($engine_pkg), ggml CPU variants: ${kept_cpu[*]}"

# 5. The image set.
say "building the image set into $out"
"$root/guest-image/build.sh" --payload-dir "$payload" --payload-config "$here/payload.json" \
    --payload-manifest "$work/payload-manifest.json" "$out"
end=$(date +%s.%N)
say "done in $(awk "BEGIN {printf \"%.1f\", $end - $start}") s: push a GGUF model with tenantvm model push, then tenantvm payload restart"
