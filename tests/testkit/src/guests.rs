//! Where the test guests are, building them on first use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Why a guest image is not available.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// scripts/build-test-guests.sh could not be run or failed.
    #[error("Building the test guests failed: {0}")]
    Build(String),
    /// The image is missing after the build.
    #[error("Test guest {0} is missing after the build; run scripts/build-test-guests.sh")]
    Missing(PathBuf),
}

/// The packagings of tvm-testguest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestImage {
    /// The ELF with the PVH note (the VMM takes the PVH entry; QEMU's -kernel boots it).
    Elf,
    /// The same ELF without its PT_NOTE: loaders take the 64-bit ELF entry.
    ElfWithoutPvh,
    /// The bzImage packaging (64-bit entry at +0x200).
    BzImage,
}

impl GuestImage {
    fn file_name(self) -> &'static str {
        match self {
            Self::Elf => "tvm-testguest",
            Self::ElfWithoutPvh => "tvm-testguest.nopvh",
            Self::BzImage => "tvm-testguest.bzImage",
        }
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The folder the guests are built into: `$TENANTVM_TEST_GUESTS` when set (prebuilt guests,
/// nothing is built), else `target/test-guests` of this repository.
pub fn guests_dir() -> PathBuf {
    match std::env::var_os("TENANTVM_TEST_GUESTS") {
        Some(dir) => PathBuf::from(dir),
        None => repo_root().join("target/test-guests"),
    }
}

fn build_once() -> Result<(), String> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if std::env::var_os("TENANTVM_TEST_GUESTS").is_some() {
                return Ok(());
            }
            let script = repo_root().join("scripts/build-test-guests.sh");
            let out = Command::new(&script)
                .output()
                .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "{} exited with {}: {}",
                    script.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(())
        })
        .clone()
}

/// The path of a test guest image, building the guests first (once per process; a no-op
/// when nothing changed).
pub fn guest(image: GuestImage) -> Result<PathBuf, GuestError> {
    build_once().map_err(GuestError::Build)?;
    let path = guests_dir().join(image.file_name());
    if path.is_file() {
        Ok(path)
    } else {
        Err(GuestError::Missing(path))
    }
}

/// Why `/dev/kvm` cannot be used here, or `None` when it can.
pub fn kvm_unavailable() -> Option<String> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => None,
        Err(e) => Some(format!("/dev/kvm is not usable here ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_have_distinct_names() {
        let names = [
            GuestImage::Elf,
            GuestImage::ElfWithoutPvh,
            GuestImage::BzImage,
        ]
        .map(GuestImage::file_name);
        assert_eq!(
            names,
            [
                "tvm-testguest",
                "tvm-testguest.nopvh",
                "tvm-testguest.bzImage"
            ]
        );
    }
}

#[cfg(test)]
mod packaging_tests {
    use super::*;
    use linux_loader::loader::{bzimage::BzImage, elf::Elf, KernelLoader};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    fn memory() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap()
    }

    #[test]
    fn bzimage_loads_at_code32_start_with_its_64_bit_entry_stub_at_0x200() {
        let path = guest(GuestImage::BzImage).unwrap();
        let mem = memory();
        let mut file = std::fs::File::open(&path).unwrap();
        let loaded = BzImage::load(&mem, None, &mut file, Some(GuestAddress(0x10_0000))).unwrap();
        assert_eq!(loaded.kernel_load, GuestAddress(0x10_0000));
        let header = loaded.setup_header.unwrap();
        assert_eq!({ header.version }, 0x020f);
        assert_eq!({ header.xloadflags } & 1, 1, "XLF_KERNEL_64");
        // The stub at +0x200 starts with `cli` (0xfa) and is the ELF's own code there.
        let mut stub = [0u8; 16];
        mem.read_slice(&mut stub, GuestAddress(0x10_0200)).unwrap();
        assert_eq!(stub[0], 0xfa);
        let elf = std::fs::read(guest(GuestImage::Elf).unwrap()).unwrap();
        let offset = elf
            .windows(16)
            .position(|w| w == stub)
            .expect("stub bytes come from the ELF");
        assert!(offset > 0);
    }

    #[test]
    fn elf_has_the_pvh_note_and_the_stripped_copy_does_not() {
        let with = Elf::load(
            &memory(),
            None,
            &mut std::fs::File::open(guest(GuestImage::Elf).unwrap()).unwrap(),
            Some(GuestAddress(0x10_0000)),
        )
        .unwrap();
        assert!(matches!(
            with.pvh_boot_cap,
            linux_loader::loader::PvhBootCapability::PvhEntryPresent(_)
        ));
        let without = Elf::load(
            &memory(),
            None,
            &mut std::fs::File::open(guest(GuestImage::ElfWithoutPvh).unwrap()).unwrap(),
            Some(GuestAddress(0x10_0000)),
        )
        .unwrap();
        assert!(!matches!(
            without.pvh_boot_cap,
            linux_loader::loader::PvhBootCapability::PvhEntryPresent(_)
        ));
        assert_eq!(with.kernel_load, without.kernel_load);
    }
}
