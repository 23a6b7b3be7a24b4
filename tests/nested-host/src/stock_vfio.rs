//! A passed-through PCI device seen by the stock Debian kernel: tenantvm-vmm boots it with a
//! busybox initramfs and `--device vfio,path=...`, and the guest's /init lists its PCI
//! devices the way `lspci -nn` does (busybox has no `lspci` applet, so from
//! `/sys/bus/pci/devices/*/{class,vendor,device}`), one `NHSK: lspci` line each. The device
//! must be listed with the vendor:device ids the host's sysfs gives it.
//!
//! Run by the nested host's `vfio-passthrough` scenario on QEMU's edu (`nh-stock-kernel
//! vfio`), and on a real host by the gated test `tests/stock_vfio.rs`
//! (`TENANTVM_TEST_VFIO_DEVICE`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::cpio::Cpio;
use crate::vm::SerialVm;

/// The guest's /init: mounts sysfs, lists the PCI devices, powers off.
pub const INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
$B mkdir -p /proc /sys /dev
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B echo "NHSK: userspace reached"
for d in /sys/bus/pci/devices/*; do
  [ -e "$d/vendor" ] || continue
  c=$($B cat "$d/class"); v=$($B cat "$d/vendor"); p=$($B cat "$d/device")
  c=${c#0x}
  $B echo "NHSK: lspci ${d##*/} [${c%??}]: [${v#0x}:${p#0x}]"
done
$B echo "NHSK: lspci done"
$B poweroff -f
"#;

/// How long the boot to the end of the listing may take (the nested host is slow).
pub const TIMEOUT: Duration = Duration::from_secs(240);
/// Guest RAM (MiB); the VMM maps it all for DMA, so RLIMIT_MEMLOCK must allow it.
pub const MEMORY_MIB: u32 = 256;

/// The initramfs: busybox and [`INIT`].
pub fn initramfs(busybox: &Path) -> std::io::Result<Vec<u8>> {
    let mut c = Cpio::new();
    c.dir("bin").dir("proc").dir("sys").dir("dev");
    c.file("init", INIT.as_bytes(), true);
    c.file("bin/busybox", &std::fs::read(busybox)?, true);
    c.symlink("bin/sh", "busybox");
    Ok(c.finish())
}

/// `vendor:device` of a host sysfs device directory, lower-case hex without `0x`.
pub fn sysfs_ids(dev: &Path) -> Result<String, String> {
    let id = |file: &str| {
        std::fs::read_to_string(dev.join(file))
            .map(|s| s.trim().trim_start_matches("0x").to_lowercase())
            .map_err(|e| format!("reading {}/{file}: {e}", dev.display()))
    };
    Ok(format!("{}:{}", id("vendor")?, id("device")?))
}

/// The `vendor:device` ids of the guest's `NHSK: lspci` lines.
pub fn listed_ids(serial: &str) -> Vec<String> {
    serial
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("NHSK: lspci "))
        .filter_map(|l| l.rsplit_once(": [")?.1.strip_suffix(']').map(str::to_owned))
        .collect()
}

/// What a run needs.
pub struct Run {
    /// tenantvm-vmm.
    pub vmm: PathBuf,
    /// The stock kernel (vmlinux or bzImage).
    pub kernel: PathBuf,
    /// A busybox binary (static).
    pub busybox: PathBuf,
    /// A scratch folder (initramfs, serial log).
    pub work: PathBuf,
    /// The device's sysfs directory, bound to a VFIO driver.
    pub device: PathBuf,
}

impl Run {
    /// Boots, waits for the listing and the VMM's exit (0, power-off), and checks the
    /// device is listed with its host ids. Returns the guest's listing.
    pub fn check(&self) -> Result<String, String> {
        let ids = sysfs_ids(&self.device)?;
        let image = initramfs(&self.busybox)
            .map_err(|e| format!("reading {}: {e}", self.busybox.display()))?;
        let initramfs = self.work.join("vfio-initramfs.cpio");
        std::fs::write(&initramfs, image)
            .map_err(|e| format!("writing {}: {e}", initramfs.display()))?;
        let mut cmd = Command::new(&self.vmm);
        cmd.arg("--kernel")
            .arg(&self.kernel)
            .arg("--initramfs")
            .arg(&initramfs)
            .args(["--memory-mib", &MEMORY_MIB.to_string(), "--rng", "off"])
            .args([
                "--cmdline",
                "console=ttyS0 reboot=k panic=1 quiet rdinit=/init",
            ])
            .arg("--device")
            .arg(format!("vfio,path={}", self.device.display()));
        let mut vm = SerialVm::spawn(cmd, &self.work.join("vfio-serial.log"))
            .map_err(|e| format!("starting {}: {e}", self.vmm.display()))?;
        vm.wait_for("NHSK: lspci done", TIMEOUT)?;
        let status = vm.wait_exit(Duration::from_secs(60));
        let serial = vm.serial();
        let listing: Vec<&str> = serial
            .lines()
            .filter(|l| l.starts_with("NHSK: lspci "))
            .collect();
        let listing = listing.join("\n");
        if !listing_has(&serial, &ids) {
            return Err(format!("{ids} is not in the guest's listing:\n{listing}"));
        }
        match status.and_then(|s| s.code()) {
            Some(0) => Ok(listing),
            other => Err(format!(
                "the VMM exited {other:?} after the listing, not 0 (power-off): {}",
                vm.serial_tail(5)
            )),
        }
    }
}

fn listing_has(serial: &str, ids: &str) -> bool {
    listed_ids(serial).iter().any(|i| i == ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_lines_give_vendor_device_ids() {
        let serial = "noise\r\nNHSK: lspci 0000:00:00.0 [0600]: [8086:0d57]\r\n\
                      NHSK: lspci 0000:00:04.0 [00ff]: [1234:11e8]\nNHSK: lspci done\n\
                      NHSK: lspci broken\n";
        assert_eq!(listed_ids(serial), ["8086:0d57", "1234:11e8"]);
        assert!(listing_has(serial, "1234:11e8"));
        assert!(!listing_has(serial, "10de:2330"));
    }

    #[test]
    fn sysfs_ids_are_lower_case_without_prefix() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("vendor"), "0x10DE\n").unwrap();
        std::fs::write(dir.path().join("device"), "0x2330\n").unwrap();
        assert_eq!(sysfs_ids(dir.path()).unwrap(), "10de:2330");
        assert!(sysfs_ids(&dir.path().join("missing"))
            .unwrap_err()
            .contains("vendor"));
    }

    #[test]
    fn initramfs_holds_init_and_busybox() {
        let dir = tempfile::tempdir().unwrap();
        let bb = dir.path().join("busybox");
        std::fs::write(&bb, b"\x7fELF fake busybox").unwrap();
        let image = initramfs(&bb).unwrap();
        let text = String::from_utf8_lossy(&image);
        assert!(text.contains("NHSK: lspci done"));
        assert!(text.contains("fake busybox"));
        assert!(text.contains("TRAILER!!!"));
        initramfs(&dir.path().join("none")).unwrap_err();
    }
}
