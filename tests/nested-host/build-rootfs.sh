#!/usr/bin/env bash
# Builds the nested host's outer-guest root file system from what setup and the build already
# made, cached by content hash:
#
#   kernel       .cache/kernel (scripts/setup.sh): the modules the outer guest loads (kvm,
#                kvm-amd, the vfio set, vhost_vsock, dm_crypt, loop, virtio, ext4; nvme for
#                the gpu-vgpu-sriov scenario's SR-IOV PF) and those
#                the stock-kernel scenario packs for its inner guest, with depmod's files; the
#                kernel images themselves, for the inner guests
#   tools        busybox (all applets), cryptsetup and mke2fs with their libraries (ldd)
#   binaries     tenantvm-vmm, tenantvm, tenantvmd, tenantvm-jail and the nh-* scenario
#                programs of NH_BIN, the static guest tools, the VMM's KVM test binaries:
#                each with the shared libraries ldd finds, debug info stripped
#   guest image  NH_GUEST_IMAGE (guest-image/build.sh), test guests NH_TEST_GUESTS
#   harness      init.sh (PID 1), run-scenarios.sh, lib.sh, nvme-vf.sh, scenarios/*.sh
#   needs        extras a scenario names in its `# needs:` header: `qemu` (QEMU with its
#                libraries and firmware), `llama` (the llama.cpp engine's image set and test
#                model, NH_LLAMA_IMAGE and NH_LLAMA_MODEL, where the inputs name them) or an
#                absolute path (a program comes with the shared libraries ldd finds)
#
# Project artifacts keep their host paths inside (the VMM's test binaries name the VMM by
# its build path), so a scenario sees the same NH_* paths here and on a real host.
#
# The output directory, .cache/nested-host/<format>-<hash>/, holds `initrd` (initramfs
# format: the whole root; ext4 format: a small first stage that mounts the root) and, for
# ext4, `root.ext4` (mke2fs -d, no root needed). <hash> is the SHA-256 of the list of every
# file's destination, mode and content hash, so the image is rebuilt when any input changes
# and reused otherwise. The same inputs give the same bytes: sorted entries, fixed owners,
# times, UUID and hash seed.
#
# usage: build-rootfs.sh [--format ext4|initramfs] [--need NEED]... INPUTS_FILE
#        INPUTS_FILE: KEY=VALUE lines written by tests/nested-host/prepare.sh (NH_BIN,
#        NH_GUEST_TOOLS, NH_GUEST_IMAGE, NH_TEST_GUESTS, NH_KVM_TESTS_LIST). Prints the
#        output directory on stdout.
# env:   TENANTVM_KERNEL_DIR (default .cache/kernel), NH_CACHE (default .cache/nested-host)
set -euo pipefail
umask 022
export LC_ALL=C TZ=UTC

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
format=ext4
needs=()
inputs=""
while [ $# -gt 0 ]; do
    case "$1" in
        --format) format="${2:?--format needs ext4 or initramfs}"; shift 2 ;;
        --need) needs+=("${2:?--need needs a value}"); shift 2 ;;
        -*) echo "build-rootfs: unknown option $1" >&2; exit 2 ;;
        *) inputs="$1"; shift ;;
    esac
done
case "$format" in ext4|initramfs) ;; *) echo "build-rootfs: --format must be ext4 or initramfs" >&2; exit 2 ;; esac

die() { printf 'nested-host: %s\n' "$*" >&2; exit 1; }
say() { printf 'nested-host: %s\n' "$*" >&2; }

[ -n "$inputs" ] || die "usage: build-rootfs.sh [--format ext4|initramfs] [--need NEED]... INPUTS_FILE"
[ -f "$inputs" ] || die "$inputs is missing: run scripts/nested-host.sh (or tests/nested-host/prepare.sh) to build the inputs"
NH_BIN="" NH_GUEST_TOOLS="" NH_GUEST_IMAGE="" NH_TEST_GUESTS="" NH_KVM_TESTS_LIST=""
NH_LLAMA_IMAGE="" NH_LLAMA_MODEL=""
while IFS='=' read -r key value; do
    case "$key" in
        NH_BIN|NH_GUEST_TOOLS|NH_GUEST_IMAGE|NH_TEST_GUESTS|NH_KVM_TESTS_LIST|NH_LLAMA_IMAGE|NH_LLAMA_MODEL)
            printf -v "$key" '%s' "$value" ;;
    esac
done <"$inputs"

kdir="${TENANTVM_KERNEL_DIR:-$root/.cache/kernel}"
# Absolute: the kernel's files keep their host paths in the root (NH_KERNEL_DIR).
[ -d "$kdir" ] && kdir="$(cd "$kdir" && pwd)"
cache="${NH_CACHE:-$root/.cache/nested-host}"
for tool in busybox cryptsetup mke2fs debugfs dumpe2fs depmod modinfo cpio ldd strip sha256sum; do
    command -v "$tool" >/dev/null || die "$tool is missing: run scripts/setup.sh"
done
[ -f "$kdir/vmlinuz" ] && [ -f "$kdir/vmlinux" ] && [ -f "$kdir/version" ] ||
    die "no stock kernel in $kdir (vmlinuz, vmlinux, version): run scripts/setup.sh"
kver="$(cat "$kdir/version")"
kmods="$kdir/modules"
[ -f "$kmods/modules.builtin" ] || die "no kernel modules in $kmods: run scripts/setup.sh"
for bin in tenantvm-vmm nh-stock-kernel nh-guest-image nh-vfio-kernel; do
    [ -x "$NH_BIN/$bin" ] || die "$NH_BIN/$bin is missing: run scripts/nested-host.sh (it builds it) or tests/nested-host/prepare.sh"
done
[ -x "$NH_GUEST_TOOLS/nh-vsock-echo" ] || die "$NH_GUEST_TOOLS/nh-vsock-echo is missing: run tests/nested-host/prepare.sh"
for f in vmlinuz vmlinux initramfs.cpio.gz cmdline manifest.json; do
    [ -f "$NH_GUEST_IMAGE/$f" ] || die "guest image file $NH_GUEST_IMAGE/$f is missing: run guest-image/build.sh"
done
[ -f "$NH_TEST_GUESTS/tvm-testguest" ] || die "test guests missing in $NH_TEST_GUESTS: run scripts/build-test-guests.sh"
[ -f "$NH_KVM_TESTS_LIST" ] || die "the list of the VMM's KVM test binaries ($NH_KVM_TESTS_LIST) is missing: run tests/nested-host/prepare.sh"

# ---- 1. The file list: destination -> source (files), destination -> target (links).
declare -A src_of=() link_of=() mode_of=() strip_of=()
add_file() { # SRC DEST [MODE] [strip]
    [ -e "$1" ] || die "input $1 is missing"
    src_of["$2"]="$(readlink -f "$1")"
    mode_of["$2"]="${3:-0644}"
    strip_of["$2"]="${4:-}"
}
add_link() { link_of["$2"]="$1"; }
add_libs() { # ELF: the shared libraries ldd finds, at their own paths
    local lib
    while read -r lib; do
        [ -n "$lib" ] || continue
        add_file "$lib" "$lib" 0755
        # The loader path (/lib64/ld-linux-x86-64.so.2) and the library's soname links.
    done < <(ldd "$1" 2>/dev/null | awk '/=> \// {print $3} $1 ~ /^\// {print $1}')
}
add_elf() { # SRC DEST [strip]
    add_file "$1" "$2" 0755 "${3:-}"
    add_libs "$1"
}

# busybox with every applet as a link.
add_file "$(command -v busybox)" /bin/busybox 0755
for applet in $(busybox --list); do
    case "$applet" in busybox) continue ;; esac
    add_link /bin/busybox "/bin/$applet"
done
# cryptsetup and mke2fs (the orchestrator's disk code links libcryptsetup, found by ldd of
# the programs below); glibc dlopens libgcc_s for thread cancellation.
add_elf "$(command -v cryptsetup)" /sbin/cryptsetup
add_elf "$(command -v mke2fs)" /sbin/mke2fs
add_file /etc/mke2fs.conf /etc/mke2fs.conf
add_file "$(readlink -f /lib/x86_64-linux-gnu/libgcc_s.so.1)" /lib/x86_64-linux-gnu/libgcc_s.so.1

# Kernel modules: the outer guest's and the stock-kernel scenario's inner guest's, with
# everything they depend on.
modules=(
    virtio_pci virtio_blk virtio_console virtio_rng ext4
    irqbypass ccp kvm kvm_amd
    vfio vfio_iommu_type1 vfio_virqfd vfio_pci_core vfio_pci
    vhost_vsock vsock vmw_vsock_virtio_transport
    dm_crypt loop xts aesni_intel algif_skcipher algif_hash crc32c_intel crc32c_generic
    nvme
)
declare -A path_of=() seen=()
while read -r p; do
    n="$(basename "$p" .ko)"
    path_of[${n//-/_}]="$p"
done < <(cd "$kmods" && find kernel -name '*.ko' | sort)
builtin="$(sed 's/-/_/g' "$kmods/modules.builtin")"
merged="vfio_virqfd"
closure=()
resolve() {
    local n="${1//-/_}" p d
    [ -n "${seen[$n]:-}" ] && return 0
    seen[$n]=1
    p="${path_of[$n]:-}"
    if [ -z "$p" ]; then
        grep -q "/${n}.ko\$" <<<"$builtin" && return 0
        # Merged into another module in later kernels (vfio_virqfd into vfio in Linux 6.2,
        # e.g. scripts/build-iommufd-kernel.sh's 6.12): nothing to load.
        case " $merged " in *" $n "*) return 0 ;; esac
        die "kernel module $n is neither in $kmods nor built in: run scripts/setup.sh"
    fi
    for d in $(modinfo -F depends "$kmods/$p" | tr ',' ' '); do resolve "$d"; done
    closure+=("$p")
}
for m in "${modules[@]}"; do resolve "$m"; done
mdir="/lib/modules/$kver"
for p in "${closure[@]}"; do add_file "$kmods/$p" "$mdir/$p"; done
for f in modules.builtin modules.builtin.modinfo modules.order; do add_file "$kmods/$f" "$mdir/$f"; done
# The kernel directory at its host path, for the inner guests (modules: the same tree).
add_file "$kdir/vmlinuz" "$kdir/vmlinuz"
add_file "$kdir/vmlinux" "$kdir/vmlinux"
add_file "$kdir/version" "$kdir/version"
add_link "$mdir" "$kdir/modules"

# The project's binaries and the scenario programs, at their build paths.
for bin in tenantvm-vmm tenantvm tenantvmd tenantvm-jail; do
    [ -x "$NH_BIN/$bin" ] && add_elf "$NH_BIN/$bin" "$NH_BIN/$bin" strip
done
for bin in "$NH_BIN"/nh-*; do
    [ -x "$bin" ] && [ -f "$bin" ] && add_elf "$bin" "$bin" strip
done
add_file "$NH_GUEST_TOOLS/nh-vsock-echo" "$NH_GUEST_TOOLS/nh-vsock-echo" 0755 strip
while read -r t; do
    [ -n "$t" ] || continue
    add_elf "$t" "$t" strip
done <"$NH_KVM_TESTS_LIST"
for g in "$NH_TEST_GUESTS"/tvm-testguest*; do add_file "$g" "$g"; done
add_image_set() { # DIR: a guest image set (guest-image/build.sh) at its own path
    local f
    for f in vmlinuz vmlinux initramfs.cpio.gz cmdline manifest.json SHA256SUMS; do
        [ -f "$1/$f" ] && add_file "$1/$f" "$1/$f"
    done
    return 0
}
add_image_set "$NH_GUEST_IMAGE"

# The harness.
nh=/opt/nested-host
add_file "$here/init.sh" /init 0755
add_file "$here/run-scenarios.sh" "$nh/run-scenarios.sh" 0755
add_file "$here/lib.sh" "$nh/lib.sh"
add_file "$here/nvme-vf.sh" "$nh/nvme-vf.sh" 0755
for s in "$here"/scenarios/*.sh; do add_file "$s" "$nh/scenarios/$(basename "$s")" 0755; done

# The paths the scenarios get (NH_* variables, the same names run-scenarios.sh gets on a
# real host).
add_file "$NH_KVM_TESTS_LIST" "$NH_KVM_TESTS_LIST"
env_file="NH_BIN=$NH_BIN
NH_GUEST_TOOLS=$NH_GUEST_TOOLS
NH_GUEST_IMAGE=$NH_GUEST_IMAGE
NH_TEST_GUESTS=$NH_TEST_GUESTS
NH_KVM_TESTS_LIST=$NH_KVM_TESTS_LIST
NH_KERNEL_DIR=$kdir
NH_SCENARIOS=$nh/scenarios
NH_LIB=$nh/lib.sh"

# What scenarios asked for.
for need in "${needs[@]}"; do
    case "$need" in
        qemu)
            qemu="$(command -v qemu-system-x86_64)" || die "qemu-system-x86_64 is missing: run scripts/setup.sh"
            add_elf "$qemu" /usr/bin/qemu-system-x86_64
            for fw in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
                      /usr/share/qemu/kvmvapic.bin /usr/share/qemu/pvh.bin \
                      /usr/share/seabios/bios-microvm.bin /usr/share/qemu/qboot.rom; do
                [ -f "$fw" ] && add_file "$fw" "$fw"
                # QEMU's data directory links to the firmware packages' files.
                [ -L "/usr/share/qemu/$(basename "$fw")" ] && add_link "$fw" "/usr/share/qemu/$(basename "$fw")"
            done
            ;;
        llama)
            # The llama.cpp engine's image set and test model, where prepare.sh found them
            # (guest-image/variants/llama-cpp/prepare.sh ran first); without them the
            # scenarios that need llama skip, naming that command.
            if [ -n "$NH_LLAMA_IMAGE" ] && [ -n "$NH_LLAMA_MODEL" ]; then
                add_image_set "$NH_LLAMA_IMAGE"
                add_file "$NH_LLAMA_MODEL" "$NH_LLAMA_MODEL"
                env_file="$env_file
NH_LLAMA_IMAGE=$NH_LLAMA_IMAGE
NH_LLAMA_MODEL=$NH_LLAMA_MODEL"
            fi
            ;;
        /*)
            if [ -d "$need" ]; then
                while read -r f; do
                    if [ -x "$f" ]; then add_elf "$f" "$f"; else add_file "$f" "$f"; fi
                done < <(find "$need" -type f | sort)
            elif [ -x "$need" ]; then
                # A program: with the shared libraries ldd finds.
                add_elf "$need" "$need"
            else
                add_file "$need" "$need" 0644
            fi
            ;;
        *) die "unknown need '$need' (use qemu, llama or an absolute path)" ;;
    esac
done

# ---- 2. The content hash of that list (and of this script).
hash_input() {
    local dest
    echo "format $format $(sha256sum <"${BASH_SOURCE[0]}" | cut -d' ' -f1)"
    for dest in "${!src_of[@]}"; do
        echo "f $dest ${mode_of[$dest]} ${strip_of[$dest]:-keep} ${src_of[$dest]}"
    done | sort | while read -r _ dest mode strip src; do
        echo "f $dest $mode $strip $(sha256sum <"$src" | cut -d' ' -f1)"
    done
    for dest in "${!link_of[@]}"; do echo "l $dest ${link_of[$dest]}"; done | sort
    printf 'e %s\n' $env_file
}
manifest="$(hash_input)"
hash="$(printf '%s\n' "$manifest" | sha256sum | cut -c1-16)"
out="$cache/$format-$hash"
if [ -f "$out/done" ]; then
    touch "$out/done"
    echo "$out"
    exit 0
fi

# ---- 3. Stage and pack.
start=$(date +%s.%N)
say "building the outer root file system ($format, ${#src_of[@]} files) into $out"
mkdir -p "$cache"
work="$(mktemp -d "$cache/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
stage="$work/root"
mkdir -p "$stage"/{proc,sys,dev,tmp,run,scratch,mnt,root,etc}
declare -A first_of=()
for dest in $(printf '%s\n' "${!src_of[@]}" | sort); do
    src="${src_of[$dest]}"
    install -D -m "${mode_of[$dest]}" "$src" "$stage$dest"
    if [ -n "${strip_of[$dest]}" ]; then
        strip --strip-debug "$stage$dest" 2>/dev/null || true
    fi
    # Identical sources (the kernel images in the kernel and guest image directories) are
    # stored once, as hard links.
    if [ -n "${first_of[$src]:-}" ] && [ -z "${strip_of[$dest]}" ]; then
        ln -f "$stage${first_of[$src]}" "$stage$dest"
    else
        first_of[$src]="$dest"
    fi
done
for dest in $(printf '%s\n' "${!link_of[@]}" | sort); do
    mkdir -p "$(dirname "$stage$dest")"
    ln -sfn "${link_of[$dest]}" "$stage$dest"
done
printf '%s\n' "$env_file" >"$stage$nh/env"
depmod -b "$stage" "$kver"
ln -s /proc/mounts "$stage/etc/mtab"
epoch=1700000000
find "$stage" -exec touch -h -d "@$epoch" {} +

pack_cpio() { # DIR -> stdout, sorted newc with fixed owners
    (cd "$1" && find . -mindepth 1 -printf '%P\0' | sort -z |
        cpio --null --create --format=newc --reproducible --owner=0:0 --quiet)
}
if [ "$format" = initramfs ]; then
    # Uncompressed: under TCG the kernel unpacks a plain cpio faster than it inflates one.
    pack_cpio "$stage" >"$work/initrd"
else
    # The ext4 image, sized to its contents plus room for depmod's files and a margin; the
    # outer guest mounts it read-only.
    kib="$(du -sk --apparent-size "$stage" | cut -f1)"
    size_mib=$(( kib / 1024 * 5 / 4 + 64 ))
    uuid="$(printf '%s' "$hash" | sha256sum | sed -E 's/^(.{8})(.{4})(.{4})(.{4})(.{12}).*/\1-\2-\3-\4-\5/')"
    truncate -s "${size_mib}M" "$work/root.ext4"
    E2FSPROGS_FAKE_TIME=$epoch mke2fs -q -F -t ext4 -L nh-root -U "$uuid" \
        -E "hash_seed=$uuid,root_owner=0:0,lazy_itable_init=0" -O ^has_journal -m 0 \
        -d "$stage" "$work/root.ext4" >&2
    # mke2fs -d copies each inode's change time from the staged file, which nothing can set,
    # and its access time, which mke2fs's own reads move: fix both to the epoch so that the
    # same inputs give the same image. It numbers inodes in order, so the used ones are the
    # root (2) and 11 up to the count in use.
    used="$(dumpe2fs -h "$work/root.ext4" 2>/dev/null | awk -F: '
        /^Inode count/ { total = $2 } /^Free inodes/ { free = $2 } END { print total - free }')"
    for ino in 2 $(seq 11 "$used"); do
        printf 'sif <%s> ctime @%s\nsif <%s> atime @%s\n' "$ino" "$epoch" "$ino" "$epoch"
    done >"$work/times.debugfs"
    E2FSPROGS_FAKE_TIME=$epoch debugfs -w -f "$work/times.debugfs" "$work/root.ext4" >/dev/null 2>&1 ||
        die "debugfs could not fix the inode times of the root image"
    # The first stage: busybox and the modules that reach the root disk.
    s1="$work/stage1"
    mkdir -p "$s1"/{bin,proc,sys,dev,newroot}
    cp -a "$stage/bin/busybox" "$s1/bin/busybox"
    for applet in sh mount umount switch_root modprobe insmod cat echo ls sleep mkdir poweroff; do
        ln -s busybox "$s1/bin/$applet"
    done
    ln -s bin "$s1/sbin"
    s1mods=()
    for m in virtio_pci virtio_blk crc32c_generic ext4; do
        seen=() closure=()
        resolve "$m"
        s1mods+=("${closure[@]}")
    done
    for p in "${s1mods[@]}"; do install -D -m 0644 "$kmods/$p" "$s1$mdir/$p"; done
    # (The folder exists even when every first-stage module is built in.)
    mkdir -p "$s1$mdir"
    cp "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo "$kmods"/modules.order "$s1$mdir/"
    depmod -b "$s1" "$kver"
    cp -a "$stage/init" "$s1/init"
    touch "$s1/nh-stage1"
    find "$s1" -exec touch -h -d "@$epoch" {} +
    pack_cpio "$s1" >"$work/initrd"
fi
mkdir -p "$out.tmp"
mv "$work/initrd" "$out.tmp/"
[ -f "$work/root.ext4" ] && mv "$work/root.ext4" "$out.tmp/"
printf '%s\n' "$manifest" >"$out.tmp/inputs"
touch "$out.tmp/done"
rm -rf "$out"
mv "$out.tmp" "$out"
# Keep the two most recently used images of each format.
ls -1dt "$cache/$format"-* 2>/dev/null | tail -n +3 | while read -r old; do rm -rf "$old"; done
end=$(date +%s.%N)
say "outer root file system ready in $(awk "BEGIN {printf \"%.1f\", $end - $start}") s ($(du -sh "$out" | cut -f1))"
echo "$out"
