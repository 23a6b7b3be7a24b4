//! The same test guest boots through every entry the VMM offers, and the guest reports which
//! one it came through: the PVH entry (ELF note), the 64-bit ELF entry (`--boot linux`, and
//! an ELF without the note under `--boot auto`), and the bzImage 64-bit entry at +0x200.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

fn boots_through(image: GuestImage, extra: &[&str], entry: &str) {
    let out = VmRun::new(env!("CARGO_BIN_EXE_tenantvm-vmm"), guest(image).unwrap())
        .cmdline("tvm.test=boot extra=words")
        .args(extra.iter().copied())
        .run()
        .unwrap();
    let report = out
        .report("boot")
        .unwrap_or_else(|e| panic!("{e}\n{}", out.describe()));
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(report.field("entry"), Some(entry), "{}", out.describe());
    assert!(
        report
            .detail
            .contains("cmdline=\"tvm.test=boot extra=words\""),
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
}

#[test]
fn elf_with_pvh_note_boots_through_pvh() {
    require_kvm!("elf_with_pvh_note_boots_through_pvh");
    boots_through(GuestImage::Elf, &[], "pvh");
}

#[test]
fn elf_boots_through_the_64_bit_entry_when_asked() {
    require_kvm!("elf_boots_through_the_64_bit_entry_when_asked");
    boots_through(GuestImage::Elf, &["--boot", "linux"], "linux64");
}

#[test]
fn elf_without_pvh_note_boots_through_the_64_bit_entry() {
    require_kvm!("elf_without_pvh_note_boots_through_the_64_bit_entry");
    boots_through(GuestImage::ElfWithoutPvh, &[], "linux64");
}

#[test]
fn bzimage_boots_through_its_64_bit_entry() {
    require_kvm!("bzimage_boots_through_its_64_bit_entry");
    boots_through(GuestImage::BzImage, &[], "bzimage");
}
