//! Gated on a real host: `TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/DDDD:BB:DD.F`, a
//! device bound to vfio-pci, with /dev/kvm and /dev/vfio usable and RLIMIT_MEMLOCK above
//! 256 MiB. tenantvm-vmm (built: `cargo build -p tenantvm-vmm`, or `TENANTVM_VMM=PATH`)
//! boots the stock Debian kernel (.cache/kernel/vmlinux, scripts/setup.sh) with a busybox
//! initramfs and the device passed through; the guest lists its PCI devices like
//! `lspci -nn` and the device must be there with its real vendor:device ids, and the guest
//! powers off (exit 0). Prints `SKIP` without the variable. docs/testing.md.

use std::path::{Path, PathBuf};

use tenantvm_nested_host::inputs::kernel_dir;
use tenantvm_nested_host::stock_vfio::Run;

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

#[test]
fn stock_kernel_lists_the_real_device_with_its_ids() {
    let Some(device) = std::env::var_os("TENANTVM_TEST_VFIO_DEVICE").map(PathBuf::from) else {
        tenantvm_skip::skip!(
            "set TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/BDF (bound to vfio-pci) to pass a real device to the stock kernel"
        );
    };
    let root = tenantvm_nested_host::repo_root();
    let vmm = std::env::var_os("TENANTVM_VMM")
        .map_or_else(|| root.join("target/debug/tenantvm-vmm"), PathBuf::from);
    assert!(
        vmm.is_file(),
        "{} is missing: run cargo build -p tenantvm-vmm, or set TENANTVM_VMM",
        vmm.display()
    );
    let kernel = kernel_dir().join("vmlinux");
    assert!(
        kernel.is_file(),
        "{} is missing: run scripts/setup.sh",
        kernel.display()
    );
    let busybox = which("busybox").expect("busybox is not installed (run scripts/setup.sh)");
    let work = tempfile::tempdir().unwrap();
    let run = Run {
        vmm,
        kernel,
        busybox,
        work: work.path().to_path_buf(),
        device: device.clone(),
    };
    match run.check() {
        Ok(listing) => eprintln!("{}:\n{listing}", device.display()),
        Err(e) => panic!("{}: {e}", device.display()),
    }
}
