#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine to build, test, benchmark and demo tenantvm.
# Idempotent: run it as often as you like. Needs root (or sudo) for apt.
#
# usage: scripts/setup.sh [--dev]
#
# What it does:
#   1. installs the Debian packages the build, tests and demo need;
#   2. adds the Rust target the no_std test guests are built for, and rustfmt and clippy;
#   3. fetches the stock Debian kernel package (linux-image-amd64) into .cache/kernel/
#      and extracts its ELF vmlinux next to the bzImage. Nothing fetched is committed;
#   4. with --dev only (.ci/run passes it): the developer tools the CI checks use and that
#      take minutes to compile, which nobody who only wants the demo or the tests needs:
#      a nightly toolchain and cargo-fuzz (scripts/fuzz.sh), cargo-machete (unused
#      dependencies), Schemathesis (scripts/api-fuzz.sh).
set -euo pipefail

dev=0
for arg in "$@"; do
    case "$arg" in
        --dev) dev=1 ;;
        *) echo "usage: scripts/setup.sh [--dev]" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="$root/.cache"
mkdir -p "$cache"

say() { printf '\033[1msetup:\033[0m %s\n' "$*"; }

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

packages=(
    # QEMU: the compatibility backend, software emulation of Linux guests here, and
    # the peer that scripts/bench.sh measures tenantvm-vmm against.
    qemu-system-x86 qemu-utils
    # Benchmarks.
    hyperfine
    # Kernel package handling.
    xz-utils zstd cpio
    # ACPI table checks (iasl disassembles the DSDT the VMM builds).
    acpica-tools
    # Build tools for -sys crates.
    pkg-config build-essential
    # Tenant disks: libcryptsetup-rs links libcryptsetup (bindgen needs libclang);
    # the tests check images with the stock cryptsetup tool.
    libcryptsetup-dev libclang-dev cryptsetup-bin
    # The disk guest test's initramfs: busybox, and modinfo for module dependencies.
    busybox-static kmod
    # tests/guests/pack.py (bzImage packaging of the test guests) and scripts/bench.sh.
    python3
    # Guest image (guest-image/build.sh): busybox, cryptsetup and mke2fs copied into the
    # initramfs (cryptsetup also formats the test disks on the host), depmod/modinfo.
    busybox-static cryptsetup-bin e2fsprogs kmod
    # The nested test host (tests/nested-host): QEMU (TCG, q35, intel-iommu, edu, nvme) boots
    # an outer root made with mke2fs -d from busybox, cryptsetup, the kernel package's
    # modules (kvm-amd, vfio-pci, vhost_vsock, dm-crypt: all in linux-image-amd64) and the
    # build; strip and ldd come with build-essential and libc-bin.
    qemu-system-x86 e2fsprogs busybox-static cpio kmod
    # The llama.cpp engine variant (guest-image/variants/llama-cpp/prepare.sh, run by
    # scripts/test.sh): mmdebstrap unpacks Debian's llama.cpp into the payload's root; a
    # Python virtual environment holds the pinned gguf writer and OpenAI client.
    mmdebstrap python3-venv
)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    say "Debian packages present"
fi

if command -v rustup >/dev/null 2>&1; then
    rustup target list --installed | grep -qx x86_64-unknown-none || {
        say "adding Rust target x86_64-unknown-none (test guests)"
        rustup target add x86_64-unknown-none
    }
    for c in rustfmt clippy; do
        rustup component list --installed | grep -q "^$c" || rustup component add "$c"
    done
fi

# Developer tools (--dev): the CI's checks, not the demo's or the tests' needs.
if [ "$dev" = 1 ] && command -v rustup >/dev/null 2>&1; then
    # The fuzz targets (scripts/fuzz.sh) need a nightly toolchain and cargo-fuzz. They are
    # optional: without them scripts/fuzz.sh says why and skips.
    if ! rustup toolchain list | grep -q '^nightly'; then
        say "installing the nightly toolchain for the fuzz targets"
        rustup toolchain install nightly --profile minimal >/dev/null 2>&1 ||
            say "warning: no nightly toolchain; the fuzz targets will not be built"
    fi
    if ! command -v cargo-fuzz >/dev/null 2>&1 && rustup toolchain list | grep -q '^nightly'; then
        say "installing cargo-fuzz"
        cargo install cargo-fuzz --locked --quiet ||
            say "warning: cargo-fuzz did not install; the fuzz targets will not be built"
    fi
    # The API fuzzer (scripts/api-fuzz.sh): Schemathesis, pinned, in a virtual environment
    # of its own under .cache/ (never committed).
    schemathesis_version=4.32.5
    if ! "$cache/schemathesis/bin/schemathesis" --version 2>/dev/null | grep -q " $schemathesis_version$"; then
        say "installing Schemathesis $schemathesis_version"
        dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "install ok installed" ||
            DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
        { python3 -m venv "$cache/schemathesis" &&
            "$cache/schemathesis/bin/pip" install --quiet "schemathesis==$schemathesis_version"; } ||
            say "warning: Schemathesis did not install; scripts/api-fuzz.sh will skip"
    fi
    # The unused-dependency check (.ci/run). Pinned so every machine judges alike.
    machete_version=0.9.2
    if ! cargo machete --version 2>/dev/null | grep -qx "$machete_version"; then
        say "installing cargo-machete $machete_version"
        cargo install cargo-machete --version "$machete_version" --locked --quiet ||
            say "warning: cargo-machete did not install; .ci/run cannot check for unused dependencies"
    fi
fi

# The stock Debian kernel, for the boot tests and benchmarks.
kdir="$cache/kernel"
if [ ! -f "$kdir/vmlinux" ] || [ ! -f "$kdir/vmlinuz" ]; then
    say "fetching the stock Debian kernel (linux-image-amd64)"
    "${sudo_cmd[@]}" apt-get update -qq
    pkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
    [ -n "$pkg" ] || { echo "setup: cannot resolve linux-image-amd64 to a kernel package" >&2; exit 1; }
    rm -rf "$kdir.tmp" && mkdir -p "$kdir.tmp"
    (cd "$kdir.tmp" && apt-get download "$pkg" >/dev/null)
    dpkg-deb -x "$kdir.tmp"/*.deb "$kdir.tmp/root"
    mkdir -p "$kdir"
    cp "$kdir.tmp"/root/boot/vmlinuz-* "$kdir/vmlinuz"
    cp "$kdir.tmp"/root/boot/config-* "$kdir/config"
    ver="$(basename "$kdir.tmp"/root/lib/modules/*)"
    rm -rf "$kdir/modules" && mv "$kdir.tmp/root/lib/modules/$ver" "$kdir/modules"
    echo "$ver" >"$kdir/version"
    echo "$pkg" >"$kdir/package"
    python3 "$root/scripts/extract-vmlinux.py" "$kdir/vmlinuz" "$kdir/vmlinux"
    rm -rf "$kdir.tmp"
fi
say "kernel $(cat "$kdir/version"): $kdir/vmlinux (ELF), $kdir/vmlinuz (bzImage)"
if [ "$dev" = 0 ]; then
    say "developer tools (nightly, cargo-fuzz, cargo-machete, Schemathesis) not installed; scripts/setup.sh --dev adds them"
fi
say "done"
