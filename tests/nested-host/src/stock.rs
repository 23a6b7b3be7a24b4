//! The small initramfs the stock-kernel scenario boots the stock Debian kernel with: busybox,
//! the virtio modules (with what they depend on), the static nh-vsock-echo,
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

/// The module name of a `.ko` path (`kernel/drivers/char/hw_random/virtio-rng.ko` is
/// `virtio_rng`).
fn module_name(path: &Path) -> String {
    path.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .trim_end_matches(".ko")
        .replace('-', "_")
}

/// The `depends=` list of a module file's .modinfo strings (NUL-separated `key=value`).
pub fn module_depends(ko: &[u8]) -> Vec<String> {
    ko.split(|b| *b == 0)
        .find_map(|field| field.strip_prefix(b"depends="))
        .map(|deps| {
            String::from_utf8_lossy(deps)
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.replace('-', "_"))
                .collect()
        })
        .unwrap_or_default()
}

/// Every `.ko` under `dir`, by module name.
fn index_modules(dir: &Path, out: &mut BTreeMap<String, PathBuf>) -> Result<(), StockError> {
    let entries = std::fs::read_dir(dir).map_err(|source| StockError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            index_modules(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "ko") {
            out.insert(module_name(&path), path);
        }
    }
    Ok(())
}

/// The files of `wanted` and their dependencies, dependencies first, found in the kernel's
/// modules folder and the modules' own `depends=` (the kernel package ships no modules.dep;
/// depmod makes it at install time).
pub fn module_closure(
    modules: &Path,
    wanted: &[&str],
) -> Result<Vec<(String, PathBuf)>, StockError> {
    let mut index = BTreeMap::new();
    index_modules(&modules.join("kernel"), &mut index)?;
    let mut order: Vec<(String, PathBuf)> = Vec::new();
    fn visit(
        name: &str,
        index: &BTreeMap<String, PathBuf>,
        order: &mut Vec<(String, PathBuf)>,
    ) -> Result<(), StockError> {
        if order.iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        let path = index
            .get(name)
            .ok_or_else(|| StockError::NoModule(name.to_string()))?;
        for dep in module_depends(&read(path)?) {
            visit(&dep, index, order)?;
        }
        if !order.iter().any(|(n, _)| n == name) {
            order.push((name.to_string(), path.clone()));
        }
        Ok(())
    }
    for w in wanted {
        visit(&w.replace('-', "_"), &index, &mut order)?;
    }
    Ok(order)
}

/// Builds the initramfs from the kernel directory's modules, `busybox` and `vsock_echo`.
pub fn initramfs(
    kernel_dir: &Path,
    busybox: &Path,
    vsock_echo: &Path,
) -> Result<Vec<u8>, StockError> {
    let closure = module_closure(&kernel_dir.join("modules"), &MODULES)?;
    let mut c = Cpio::new();
    c.dir("bin").dir("m").dir("proc").dir("sys").dir("dev");
    c.file("init", INIT.as_bytes(), true);
    c.file("bin/busybox", &read(busybox)?, true);
    c.symlink("bin/sh", "busybox");
    c.file("bin/nh-vsock-echo", &read(vsock_echo)?, true);
    let mut order = String::new();
    for (name, path) in &closure {
        c.file(&format!("m/{name}.ko"), &read(path)?, false);
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
    fn depends_come_from_the_modinfo_strings() {
        let ko = b"\x7fELF junk\0license=GPL\0depends=virtio_ring,virtio,vsock-x\0vermagic=6.1\0";
        assert_eq!(module_depends(ko), ["virtio_ring", "virtio", "vsock_x"]);
        assert!(module_depends(b"\0depends=\0").is_empty());
        assert!(module_depends(b"no modinfo").is_empty());
    }

    #[test]
    fn dependencies_come_first_and_dashes_are_underscores() {
        let dir = tempfile::tempdir().unwrap();
        let put = |rel: &str, deps: &str| {
            let p = dir.path().join("kernel").join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("\0depends={deps}\0")).unwrap();
        };
        put(
            "a/virtio_pci.ko",
            "virtio_pci_modern_dev,virtio_ring,virtio",
        );
        put("a/virtio.ko", "");
        put("a/virtio_ring.ko", "");
        put("a/virtio_pci_modern_dev.ko", "");
        put("b/virtio-rng.ko", "virtio_ring,virtio");
        let order = module_closure(dir.path(), &["virtio_pci", "virtio-rng"]).unwrap();
        let names: Vec<&str> = order.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "virtio_pci_modern_dev",
                "virtio_ring",
                "virtio",
                "virtio_pci",
                "virtio_rng"
            ]
        );
        assert!(order[4].1.ends_with("b/virtio-rng.ko"));
        module_closure(dir.path(), &["nope"]).unwrap_err();
    }

    #[test]
    fn the_stock_kernel_modules_resolve() {
        let kdir = crate::inputs::kernel_dir();
        if !kdir.join("modules/kernel").is_dir() {
            tenantvm_skip::skip!("{} has no modules (run scripts/setup.sh)", kdir.display());
        }
        let order = module_closure(&kdir.join("modules"), &MODULES).unwrap();
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
