#!/usr/bin/env bash
# Builds a small Linux kernel with iommufd (CONFIG_IOMMUFD, CONFIG_VFIO_DEVICE_CDEV) for the
# nested test host's outer guest. Debian's kernels have `# CONFIG_IOMMUFD is not set`, so
# the VMM's iommufd/cdev VFIO path cannot run on them; this kernel is the only place it does
# here (scenario vfio-iommufd, docs/testing.md).
#
# Source: Debian's linux-source-6.12 package (bookworm-security):
#   apt-get install linux-source-6.12      # gives /usr/src/linux-source-6.12.tar.xz
# Configuration: x86_64 defconfig + kvm_guest.config, then everything the nested host needs
# built in (KVM AMD and Intel, VFIO with both the container/group and the cdev interfaces,
# iommufd, the Intel IOMMU with interrupt remapping, dm-crypt with XTS/AES, vhost-vsock,
# virtio, ext4, loop, the cgroup controllers tenantvmd uses, namespaces, TUN).
#
# Output, in the shape tests/nested-host/build-rootfs.sh takes from .cache/kernel (use it
# with TENANTVM_KERNEL_DIR=$out):
#   $out/vmlinuz $out/vmlinux $out/version $out/config
#   $out/modules/{kernel/,modules.builtin,modules.builtin.modinfo,modules.order}
#     (nearly everything is built in; build-rootfs.sh accepts a module listed in
#     modules.builtin)
# The source tree and build stay in $out/src (cached: a second run only rebuilds what
# changed). Takes 15-40 minutes on two cores.
#
# usage: scripts/build-iommufd-kernel.sh [OUT]   (default .cache/kernel-iommufd)
# env:   JOBS (default: the number of CPUs), LINUX_SOURCE (default
#        /usr/src/linux-source-6.12.tar.xz)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/.cache/kernel-iommufd}"
tarball="${LINUX_SOURCE:-/usr/src/linux-source-6.12.tar.xz}"
jobs="${JOBS:-$(nproc)}"
say() { printf '\033[1mbuild-iommufd-kernel:\033[0m %s\n' "$*" >&2; }
die() { printf 'build-iommufd-kernel: error: %s\n' "$*" >&2; exit 1; }

[ -f "$tarball" ] || die "$tarball is missing: run apt-get install linux-source-6.12 (bookworm-security)"
for tool in make gcc flex bison bc perl; do
    command -v "$tool" >/dev/null || die "$tool is missing: apt-get install build-essential flex bison bc"
done
[ -f /usr/include/libelf.h ] || die "libelf headers are missing: apt-get install libelf-dev"
[ -f /usr/include/openssl/ssl.h ] || die "OpenSSL headers are missing: apt-get install libssl-dev"

mkdir -p "$out"
out="$(cd "$out" && pwd)"
src="$out/src"
if [ ! -f "$src/Makefile" ]; then
    say "extracting $tarball into $src"
    rm -rf "$src.tmp"
    mkdir -p "$src.tmp"
    tar -C "$src.tmp" --strip-components=1 -xf "$tarball"
    mv "$src.tmp" "$src"
fi
cd "$src"

say "configuring (defconfig + kvm_guest.config + the nested host's needs)"
make -s defconfig >/dev/null
make -s kvm_guest.config >/dev/null
enable=(
    # Versioning: a fixed release string, no git or localversion suffix.
    # Virtualization: the outer guest gets emulated AMD SVM under TCG (-cpu max).
    VIRTUALIZATION KVM KVM_AMD KVM_INTEL CRYPTO_DEV_CCP CRYPTO_DEV_CCP_DD IRQ_BYPASS_MANAGER
    # The IOMMU: QEMU's intel-iommu with interrupt remapping (intremap=on).
    IOMMU_SUPPORT INTEL_IOMMU IRQ_REMAP X86_X2APIC PCI_MSI
    # VFIO: the legacy container/group interface and the iommufd/cdev one.
    VFIO VFIO_GROUP VFIO_CONTAINER VFIO_IOMMU_TYPE1 VFIO_VIRQFD VFIO_PCI_CORE VFIO_PCI
    VFIO_PCI_MMAP VFIO_PCI_INTX IOMMUFD VFIO_DEVICE_CDEV
    # Disks: dm-crypt with aes-xts, loop, ext4, the AF_ALG interface cryptsetup uses.
    MD BLK_DEV_DM DM_CRYPT CRYPTO_XTS CRYPTO_AES CRYPTO_AES_NI_INTEL CRYPTO_USER_API_SKCIPHER
    CRYPTO_USER_API_HASH CRYPTO_CRC32C CRYPTO_CRC32C_INTEL CRYPTO_SHA256 BLK_DEV_LOOP EXT4_FS
    # virtio and vsock.
    VIRTIO VIRTIO_MENU VIRTIO_PCI VIRTIO_BLK VIRTIO_NET VIRTIO_CONSOLE HW_RANDOM
    HW_RANDOM_VIRTIO VHOST_MENU VHOST VHOST_VSOCK VSOCKETS VIRTIO_VSOCKETS TUN DEVTMPFS
    DEVTMPFS_MOUNT
    # Jail and cgroups (v1 and v2 controllers), namespaces, seccomp.
    CGROUPS MEMCG CGROUP_PIDS BLK_CGROUP BLK_DEV_THROTTLING CGROUP_SCHED FAIR_GROUP_SCHED
    CFS_BANDWIDTH CGROUP_DEVICE CGROUP_CPUACCT CPUSETS NAMESPACES USER_NS PID_NS NET_NS UTS_NS
    IPC_NS SECCOMP SECCOMP_FILTER
    # cgroup v2's device allowance is a BPF program (the jail loads one per tenant).
    BPF_SYSCALL CGROUP_BPF
    # Modules stay possible (the rootfs builder runs depmod), though nothing needs one.
    MODULES
)
disable=(
    # Not needed in a TCG outer guest; dropping them halves the build.
    DRM SOUND SND WLAN WIRELESS CFG80211 MAC80211 USB_SUPPORT INPUT_JOYSTICK INPUT_TABLET
    INPUT_TOUCHSCREEN HID NETFILTER_ADVANCED AGP FB ETHERNET NET_VENDOR_INTEL MEDIA_SUPPORT
    INFINIBAND DEBUG_INFO DEBUG_INFO_DWARF5 DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT LOCALVERSION_AUTO
    KVM_AMD_SEV INTEL_IOMMU_SVM IOMMUFD_VFIO_CONTAINER VFIO_NOIOMMU
)
args=()
for o in "${enable[@]}"; do args+=(--enable "$o"); done
for o in "${disable[@]}"; do args+=(--disable "$o"); done
scripts/config "${args[@]}" --set-str LOCALVERSION "-tenantvm-iommufd" --enable INTEL_IOMMU_DEFAULT_ON
make -s olddefconfig
# olddefconfig drops what a dependency forbids: check what the VMM's path stands on.
for o in KVM KVM_AMD VFIO VFIO_PCI VFIO_GROUP VFIO_CONTAINER IOMMUFD VFIO_DEVICE_CDEV INTEL_IOMMU \
         IRQ_REMAP DM_CRYPT VHOST_VSOCK VIRTIO_VSOCKETS EXT4_FS MEMCG CGROUP_PIDS BPF_SYSCALL \
         CGROUP_BPF; do
    grep -qx "CONFIG_$o=y" .config || die "CONFIG_$o did not stay =y after olddefconfig (see $src/.config)"
done

say "building with $jobs jobs (bzImage vmlinux modules)"
start=$(date +%s)
nice -n 10 make -s -j"$jobs" bzImage modules
kver="$(make -s kernelrelease)"
say "built $kver in $(( $(date +%s) - start )) s"

stage="$out/staging"
rm -rf "$stage"
make -s INSTALL_MOD_PATH="$stage" modules_install >/dev/null
rm -rf "$out/modules.tmp"
mv "$stage/lib/modules/$kver" "$out/modules.tmp"
rm -rf "$stage"
rm -f "$out/modules.tmp/build" "$out/modules.tmp/source"
mkdir -p "$out/modules.tmp/kernel"
rm -rf "$out/modules"
mv "$out/modules.tmp" "$out/modules"
install -m 0644 arch/x86/boot/bzImage "$out/vmlinuz"
install -m 0644 vmlinux "$out/vmlinux"
install -m 0644 .config "$out/config"
printf '%s\n' "$kver" >"$out/version"
say "kernel $kver in $out (use: TENANTVM_KERNEL_DIR=$out scripts/nested-host.sh vfio-iommufd)"
