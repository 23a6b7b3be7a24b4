//! The small initramfs the stock-kernel scenario boots the stock Debian kernel with: busybox,
//! the virtio modules (resolved through the kernel's modules.dep), the static nh-vsock-echo,
//! and an /init that checks the devices and reports on the serial console with `NHSK:` lines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cpio::Cpio;

/// The modules the inner guest loads, in order after their dependencies.
pub const MODULES: [&str; 4] = [
    "virtio_pci",
    "virtio_blk",
    "virtio_rng",
    "vmw_vsock_virtio_transport",
];

/// The guest port the inner guest's vsock echo listens on (the host connects through the
/// VMM's hybrid socket).
pub const GUEST_PORT: u32 = 1234;
/// The host port the inner guest connects to (the VMM forwards to `<socket>_5000`).
pub const HOST_PORT: u32 = 5000;
/// Where in the disk the inner guest writes its pattern (512-byte sectors).
pub const PATTERN_SECTOR: u64 = 8;

/// The inner guest's /init. Kernel command line parameters: `nh.pattern=` (the disk
/// pattern), `nh.end=poweroff|reboot`, `nh.mode=check|bench` (bench: report userspace and
/// power off at once).
pub const INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
$B mkdir -p /proc /sys /dev
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t devtmpfs devtmpfs /dev
pattern=""; end=poweroff; mode=check
for a in $($B cat /proc/cmdline); do
  case "$a" in nh.pattern=*) pattern="${a#nh.pattern=}";; nh.end=*) end="${a#nh.end=}";; nh.mode=*) mode="${a#nh.mode=}";; esac
done
$B echo "NHSK: userspace reached on $($B nproc) CPUs"
if [ "$mode" = bench ]; then $B poweroff -f; fi
for m in $($B cat /m/order); do $B insmod "/m/$m.ko" || $B echo "NHSK: insmod $m failed"; done
i=0
while [ $i -lt 100 ] && ! { [ -b /dev/vda ] && [ -c /dev/hwrng ] && [ -c /dev/vsock ]; }; do $B sleep 0.1; i=$((i + 1)); done
for d in virtio_blk virtio_rng vmw_vsock_virtio_transport; do
  for l in /sys/bus/virtio/drivers/$d/virtio*; do [ -e "$l" ] && $B echo "NHSK: bound $d ${l##*/}"; done
done
$B echo "NHSK: virtio-pci functions $($B ls /sys/bus/pci/drivers/virtio-pci | $B grep -c '^0000:')"
$B echo "NHSK: rng_current $($B cat /sys/class/misc/hw_random/rng_current)"
$B echo "NHSK: disk header $($B head -c 16 /dev/vda)"
$B printf '%s' "$pattern" | $B dd of=/dev/vda bs=512 seek=8 conv=notrunc,fsync 2>/dev/null
$B sync
$B echo 3 > /proc/sys/vm/drop_caches
$B echo "NHSK: disk readback $($B dd if=/dev/vda bs=512 skip=8 count=1 2>/dev/null | $B head -c ${#pattern})"
$B echo "NHSK: rng $($B dd if=/dev/hwrng bs=32 count=1 2>/dev/null | $B od -An -tx1 | $B tr -d ' \n')"
/bin/nh-vsock-echo listen 1234 &
echo_pid=$!
$B sleep 0.5
$B echo "NHSK: vsock listening"
/bin/nh-vsock-echo connect 2 5000 "guest-hello-$pattern" | $B sed 's/^/NHSK: /'
wait $echo_pid && $B echo "NHSK: vsock echo done"
$B echo "NHSK: end $end"
$B sync
if [ "$end" = reboot ]; then $B reboot -f; else $B poweroff -f; fi
"#;

/// Why the initramfs cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum StockError {
    /// A file could not be read.
    #[error("Cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// modules.dep does not list a module.
    #[error(
        "Kernel module {0} is not in modules.dep of the kernel directory (run scripts/setup.sh)"
    )]
    NoModule(String),
}

fn read(path: &Path) -> Result<Vec<u8>, StockError> {
    std::fs::read(path).map_err(|source| StockError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The module name of a modules.dep path (`kernel/drivers/char/hw_random/virtio-rng.ko` is
/// `virtio_rng`).
fn module_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .trim_end_matches(".ko")
        .replace('-', "_")
}

/// The files of `wanted` and their dependencies, dependencies first, from the text of a
/// modules.dep.
pub fn module_closure(
    modules_dep: &str,
    wanted: &[&str],
) -> Result<Vec<(String, String)>, StockError> {
    let deps: BTreeMap<String, (String, Vec<String>)> = modules_dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(path, deps)| {
            (
                module_name(path),
                (
                    path.to_string(),
                    deps.split_whitespace().map(module_name).collect(),
                ),
            )
        })
        .collect();
    let mut order: Vec<(String, String)> = Vec::new();
    fn visit(
        name: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        order: &mut Vec<(String, String)>,
    ) -> Result<(), StockError> {
        if order.iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        let (path, ds) = deps
            .get(name)
            .ok_or_else(|| StockError::NoModule(name.to_string()))?;
        // modules.dep lists the direct dependency last; load the deepest first.
        for d in ds.iter().rev() {
            visit(d, deps, order)?;
        }
        if !order.iter().any(|(n, _)| n == name) {
            order.push((name.to_string(), path.clone()));
        }
        Ok(())
    }
    for w in wanted {
        visit(&w.replace('-', "_"), &deps, &mut order)?;
    }
    Ok(order)
}

/// Builds the initramfs from the kernel directory's modules, `busybox` and `vsock_echo`.
pub fn initramfs(
    kernel_dir: &Path,
    busybox: &Path,
    vsock_echo: &Path,
) -> Result<Vec<u8>, StockError> {
    let mdir = kernel_dir.join("modules");
    let dep = String::from_utf8_lossy(&read(&mdir.join("modules.dep"))?).into_owned();
    let closure = module_closure(&dep, &MODULES)?;
    let mut c = Cpio::new();
    c.dir("bin").dir("m").dir("proc").dir("sys").dir("dev");
    c.file("init", INIT.as_bytes(), true);
    c.file("bin/busybox", &read(busybox)?, true);
    c.symlink("bin/sh", "busybox");
    c.file("bin/nh-vsock-echo", &read(vsock_echo)?, true);
    let mut order = String::new();
    for (name, path) in &closure {
        c.file(&format!("m/{name}.ko"), &read(&mdir.join(path))?, false);
        order.push_str(name);
        order.push('\n');
    }
    c.file("m/order", order.as_bytes(), false);
    Ok(c.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_come_first_and_dashes_are_underscores() {
        let dep = "kernel/a/virtio_pci.ko: kernel/a/virtio_pci_modern_dev.ko kernel/a/virtio_ring.ko kernel/a/virtio.ko\n\
                   kernel/a/virtio.ko:\nkernel/a/virtio_ring.ko:\n\
                   kernel/a/virtio_pci_modern_dev.ko:\nkernel/b/virtio-rng.ko: kernel/a/virtio_ring.ko kernel/a/virtio.ko\n";
        let order = module_closure(dep, &["virtio_pci", "virtio-rng"]).unwrap();
        let names: Vec<&str> = order.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "virtio",
                "virtio_ring",
                "virtio_pci_modern_dev",
                "virtio_pci",
                "virtio_rng"
            ]
        );
        assert_eq!(order[4].1, "kernel/b/virtio-rng.ko");
        assert!(module_closure(dep, &["nope"]).is_err());
    }

    #[test]
    fn the_stock_kernel_modules_resolve() {
        let kdir = crate::inputs::kernel_dir();
        let Ok(dep) = std::fs::read_to_string(kdir.join("modules/modules.dep")) else {
            tenantvm_skip::skip!(
                "{} has no modules.dep (run scripts/setup.sh)",
                kdir.display()
            );
        };
        let order = module_closure(&dep, &MODULES).unwrap();
        let names: Vec<&str> = order.iter().map(|(n, _)| n.as_str()).collect();
        for m in MODULES {
            assert!(names.contains(&m), "{names:?}");
        }
        let pos = |m: &str| names.iter().position(|n| *n == m).unwrap();
        assert!(
            pos("virtio") < pos("virtio_pci") && pos("vsock") < pos("vmw_vsock_virtio_transport")
        );
    }
}
