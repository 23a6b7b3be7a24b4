#!/usr/bin/env bash
# Builds the tenantvm guest image set from Debian packages and this repository:
#
#   vmlinuz, vmlinux         the stock Debian kernel (.cache/kernel, from scripts/setup.sh)
#   initramfs.cpio.gz        /init = tenantvm-agent (static), busybox-static, cryptsetup and
#                            mke2fs with their shared libraries, the kernel modules the agent
#                            loads (with modules.dep from depmod), the agent config, and the
#                            CI payload (tenantvm-ngram + a model trained here from
#                            guest-image/corpus/*.txt)
#   cmdline                  the kernel command line to boot it with
#   manifest.json, SHA256SUMS  hashes of every output and of the inputs that made them
#
# Reproducible: sorted cpio newc entries with inode numbers from --reproducible, uid/gid 0,
# every mtime set to SOURCE_DATE_EPOCH, gzip -n. The same inputs give the same hashes
# (guest-image/agent/tests/image_reproducible.rs checks it).
#
# usage: guest-image/build.sh [--payload-dir DIR --payload-config FILE [--payload-manifest JSON]]
#                             [--prefix-cache on|off] [OUT_DIR]
#        OUT_DIR defaults to .cache/guest-image. With --payload-dir, DIR (a root file system
#        directory, e.g. an OCI image unpacked with `umoci unpack`) becomes /payload instead of
#        the CI payload, and FILE (JSON: the agent config's "payload" object) says how to run
#        it; see docs/guest-image.md. --payload-manifest JSON (a file) is recorded in
#        manifest.json under "payload" (the llama-cpp variant: the engine's version and
#        packages). --prefix-cache on builds the CI payload with its prefix
#        cache on (default off): the positive control of `tenantvm verify`'s timing check.
# env:   SOURCE_DATE_EPOCH (default: the last commit time of guest-image/, else 0)
#        TENANTVM_KERNEL_DIR (default: .cache/kernel)
set -euo pipefail
umask 022
export LC_ALL=C TZ=UTC

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
payload_dir="" payload_config="" payload_manifest="" out="" prefix_cache="off"
while [ $# -gt 0 ]; do
    case "$1" in
        --payload-dir) payload_dir="${2:?--payload-dir needs a directory}"; shift 2 ;;
        --payload-config) payload_config="${2:?--payload-config needs a file}"; shift 2 ;;
        --payload-manifest) payload_manifest="${2:?--payload-manifest needs a file}"; shift 2 ;;
        --prefix-cache) prefix_cache="${2:?--prefix-cache needs on or off}"; shift 2 ;;
        -*) echo "guest-image: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
out="${out:-$root/.cache/guest-image}"
case "$prefix_cache" in
    on|off) ;;
    *) echo "guest-image: --prefix-cache must be on or off, not $prefix_cache" >&2; exit 2 ;;
esac
if [ -n "$payload_dir" ] || [ -n "$payload_config" ]; then
    [ -d "$payload_dir" ] || { echo "guest-image: --payload-dir must name a directory" >&2; exit 2; }
    [ -f "$payload_config" ] || { echo "guest-image: --payload-config must name a JSON file" >&2; exit 2; }
fi
if [ -n "$payload_manifest" ]; then
    [ -n "$payload_dir" ] || { echo "guest-image: --payload-manifest goes with --payload-dir" >&2; exit 2; }
    [ -f "$payload_manifest" ] || { echo "guest-image: --payload-manifest must name a JSON file" >&2; exit 2; }
fi
kdir="${TENANTVM_KERNEL_DIR:-$root/.cache/kernel}"
target=x86_64-unknown-linux-gnu

say() { printf '\033[1mguest-image:\033[0m %s\n' "$*" >&2; }
die() { printf 'guest-image: error: %s\n' "$*" >&2; exit 1; }

for tool in cpio gzip depmod modinfo strip sha256sum busybox; do
    command -v "$tool" >/dev/null || die "$tool is missing; run scripts/setup.sh"
done
[ -f "$kdir/vmlinuz" ] && [ -d "$kdir/modules" ] || die "no kernel in $kdir; run scripts/setup.sh"
kver="$(cat "$kdir/version")"

if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    SOURCE_DATE_EPOCH="$(git -C "$root" log -1 --format=%ct -- guest-image 2>/dev/null || true)"
    SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-0}"
fi
export SOURCE_DATE_EPOCH

start=$(date +%s.%N)

# 1. The agent and the payload: static binaries, no C dependencies.
say "building tenantvm-agent and tenantvm-ngram (release, static)"
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$root=/src" \
    cargo build --quiet --release --locked --target "$target" \
    --manifest-path "$root/Cargo.toml" -p tenantvm-agent -p tenantvm-ngram
# Where cargo put them: CARGO_TARGET_DIR when set (else a stale or missing binary would be
# installed from $root/target).
bin="${CARGO_TARGET_DIR:-$root/target}/$target/release"

mkdir -p "$out"
stage="$out/initramfs.root"
rm -rf "$stage"
mkdir -p "$stage"/{bin,sbin,etc/tenantvm,lib64,lib/x86_64-linux-gnu,proc,sys,dev,run,tmp,data,payload,root}

# 2. PID 1 and the payload.
install -m 0755 "$bin/tenantvm-agent" "$stage/init"
strip --strip-all "$stage/init"
if [ -n "$payload_dir" ]; then
    say "payload: $payload_dir"
    cp -a "$payload_dir/." "$stage/payload/"
else
    mkdir -p "$stage/payload/bin"
    install -m 0755 "$bin/tenantvm-ngram" "$stage/payload/bin/tenantvm-ngram"
    strip --strip-all "$stage/payload/bin/tenantvm-ngram"
    say "training the CI payload's model from guest-image/corpus"
    mapfile -t corpus < <(find "$here/corpus" -name '*.txt' | sort)
    "$bin/tenantvm-ngram" train --order 3 --out "$stage/payload/model.json" "${corpus[@]}" 2>/dev/null
fi

# 3. busybox-static, for a shell and modprobe when the kernel asks for one.
install -m 0755 "$(command -v busybox)" "$stage/bin/busybox"
for applet in sh ash cat ls mkdir mount umount dmesg ps sync sleep echo; do
    ln -s busybox "$stage/bin/$applet"
done
for applet in modprobe insmod; do ln -s ../bin/busybox "$stage/sbin/$applet"; done

# 4. cryptsetup (unlock) and mke2fs (first use) with their shared libraries.
copy_with_libs() {
    local exe="$1" dest="$2"
    install -m 0755 "$exe" "$stage/$dest"
    ldd "$exe" | awk '/=> \// {print $3} $1 ~ /^\/lib64\// {print $1}' | while read -r lib; do
        local real name
        real="$(readlink -f "$lib")"
        name="$(basename "$lib")"
        case "$lib" in
            /lib64/*) install -m 0755 "$real" "$stage/lib64/$name" ;;
            *) install -m 0644 "$real" "$stage/lib/x86_64-linux-gnu/$name" ;;
        esac
    done
}
copy_with_libs "$(command -v cryptsetup)" sbin/cryptsetup
copy_with_libs "$(command -v mke2fs)" sbin/mke2fs
# glibc loads libgcc_s for thread cancellation (libargon2 runs threads).
gcc_s="$(readlink -f /lib/x86_64-linux-gnu/libgcc_s.so.1)"
install -m 0644 "$gcc_s" "$stage/lib/x86_64-linux-gnu/libgcc_s.so.1"
# The agent is static: a library it dlopens (the CUDA driver, for the gpu-memory load) needs
# libc.so.6, whose own ld-linux-x86-64.so.2 a static program's loader looks for in the
# library directories, never /lib64 (found by the load failing in a guest); Debian's layout.
ln -s /lib64/ld-linux-x86-64.so.2 "$stage/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
install -m 0644 /etc/mke2fs.conf "$stage/etc/mke2fs.conf"
# As root, prove the copied binaries find every library inside the image.
if [ "$(id -u)" -eq 0 ]; then
    for exe in /sbin/cryptsetup /sbin/mke2fs; do
        chroot "$stage" "$exe" -V >/dev/null 2>&1 || die "$exe does not run inside the image (missing library?)"
    done
fi

# 5. Kernel modules: the ones the agent loads, plus everything they depend on.
modules=(
    virtio_pci virtio_blk virtio_console
    vmw_vsock_virtio_transport
    dm_crypt xts aesni_intel algif_skcipher algif_hash
    crc32c_intel crc32c_generic ext4
)
kmods="$kdir/modules"
declare -A path_of=() seen=()
while read -r p; do
    n="$(basename "$p" .ko)"
    path_of[${n//-/_}]="$p"
done < <(cd "$kmods" && find kernel -name '*.ko' | sort)
is_builtin() { grep -q "/${1}.ko\$" <(sed 's/-/_/g' "$kmods/modules.builtin"); }
closure=()
resolve() {
    local n="${1//-/_}" p d
    [ -n "${seen[$n]:-}" ] && return 0
    seen[$n]=1
    p="${path_of[$n]:-}"
    if [ -z "$p" ]; then
        is_builtin "$n" && return 0
        die "kernel module $n is neither in $kmods nor built in"
    fi
    for d in $(modinfo -F depends "$kmods/$p" | tr ',' ' '); do resolve "$d"; done
    closure+=("$p")
}
for m in "${modules[@]}"; do resolve "$m"; done
mdir="$stage/lib/modules/$kver"
# (made here too: a kernel with every module built in, like the nested host's iommufd
# kernel, leaves the closure empty)
install -d -m 0755 "$mdir"
for p in "${closure[@]}"; do install -D -m 0644 "$kmods/$p" "$mdir/$p"; done
install -m 0644 "$kmods/modules.builtin" "$kmods/modules.builtin.modinfo" "$kmods/modules.order" "$mdir/"
depmod -b "$stage" "$kver"
find "$mdir" -maxdepth 1 -name 'modules.*' ! -name modules.dep ! -name modules.builtin -delete

# 6. The agent's config.
module_json="$(printf '"%s",' "${modules[@]}")"
# The CI payload: the built-in model from the image, models pushed to the tenant's encrypted
# disk under /data/models (docs/guest-image.md: layout and temporary names), its record in
# /data/completions.jsonl.
ci_payload='{
    "command": ["/payload/bin/tenantvm-ngram", "serve", "--model", "/payload/model.json",
                "--listen", "127.0.0.1:8000", "--data-dir", "/data", "--name", "tenantvm-ngram",
                "--models-dir", "/data/models", "--prefix-cache", "'"$prefix_cache"'"],
    "env": {"HOME": "/data"},
    "workdir": "/data",
    "port": 8000,
    "health_path": "/health"
  }'
payload_json="$ci_payload"
if [ -n "$payload_config" ]; then payload_json="$(cat "$payload_config")"; fi
cat >"$stage/etc/tenantvm/agent.json" <<EOF
{
  "modules": [${module_json%,}],
  "disk": {
    "device": "/dev/vda",
    "mapper_name": "tenantdata",
    "mount_point": "/data",
    "cryptsetup": "/sbin/cryptsetup",
    "mkfs": "/sbin/mke2fs"
  },
  "payload": $payload_json
}
EOF
"$bin/tenantvm-agent" --config "$stage/etc/tenantvm/agent.json" --check >/dev/null ||
    die "the agent config is invalid (see above); check --payload-config"

# 7. The archive: sorted, fixed owners and times, no gzip name or timestamp.
say "packing initramfs.cpio.gz"
find "$stage" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$stage" && find . -mindepth 1 -printf '%P\0' | sort -z |
    cpio --null --create --format=newc --reproducible --owner=0:0 --quiet) |
    gzip -n -6 >"$out/initramfs.cpio.gz"
install -m 0644 "$kdir/vmlinuz" "$out/vmlinuz"
install -m 0644 "$kdir/vmlinux" "$out/vmlinux"
echo "console=ttyS0 panic=-1 quiet loglevel=4" >"$out/cmdline"

# 8. Manifest: outputs, then the inputs that determine them.
(cd "$out" && sha256sum vmlinuz vmlinux initramfs.cpio.gz cmdline >SHA256SUMS)
pkgs="$(dpkg-query -W -f='${Package}=${Version}\n' busybox-static cryptsetup-bin e2fsprogs \
    libcryptsetup12 libdevmapper1.02.1 libssl3 libargon2-1 libjson-c5 libblkid1 libuuid1 \
    libudev1 libpopt0 libselinux1 libpcre2-8-0 libc6 libgcc-s1 libext2fs2 libcom-err2 libe2p2 \
    2>/dev/null | sort || true)"
python3 - "$out" "$kver" "$(cat "$kdir/package" 2>/dev/null || echo unknown)" "$pkgs" "$payload_manifest" <<'EOF'
import hashlib, json, os, stat, sys
out, kver, kpkg, pkgs, payload_manifest = sys.argv[1:6]
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
files = {n: {"sha256": sha(os.path.join(out, n)), "size": os.path.getsize(os.path.join(out, n))}
         for n in ["vmlinuz", "vmlinux", "initramfs.cpio.gz", "cmdline"]}
stage = os.path.join(out, "initramfs.root")
contents = {}
for d, _, names in os.walk(stage):
    for n in names:
        p = os.path.join(d, n)
        # Regular files only: a payload root may hold links and device nodes (reading
        # /dev/zero would never end).
        if stat.S_ISREG(os.lstat(p).st_mode):
            contents["/" + os.path.relpath(p, stage)] = sha(p)
manifest = {
    "format": 1,
    "source_date_epoch": int(os.environ["SOURCE_DATE_EPOCH"]),
    "kernel": {"release": kver, "package": kpkg},
    "debian_packages": [p for p in pkgs.splitlines() if p],
    "files": files,
    "initramfs_contents": dict(sorted(contents.items())),
}
if payload_manifest:
    with open(payload_manifest) as f:
        manifest["payload"] = json.load(f)
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2, sort_keys=True)
    f.write("\n")
EOF

end=$(date +%s.%N)
say "image set in $out ($(du -h "$out/initramfs.cpio.gz" | cut -f1) initramfs) in $(awk "BEGIN {printf \"%.1f\", $end - $start}") s"
cat "$out/SHA256SUMS" >&2
