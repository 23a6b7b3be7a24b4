//! Helpers shared by the VMM's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built VMM binary.
pub fn vmm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tenantvm-vmm"))
}

/// Whether /dev/kvm can be opened; records the skip of `test` (tenantvm-skip) when not.
pub fn kvm_available(test: &str) -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            let id = format!("{}::{test}", env!("CARGO_CRATE_NAME"));
            tenantvm_skip::record(&id, format!("/dev/kvm is not usable here ({e})"));
            false
        }
    }
}

/// A minimal x86_64 ELF executable: one PT_LOAD segment holding `code` at physical
/// address 1 MiB (the entry point), `memsz` bytes long in memory.
pub fn tiny_elf(code: &[u8], memsz: u64) -> Vec<u8> {
    const LOAD: u64 = 0x10_0000;
    const CODE_OFFSET: u64 = 0x1000;
    let mut img = Vec::new();
    img.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    img.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    img.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&LOAD.to_le_bytes()); // e_entry
    img.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    img.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    img.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        img.extend_from_slice(&v.to_le_bytes()); // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
    }
    img.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    img.extend_from_slice(&7u32.to_le_bytes()); // RWX
    for v in [
        CODE_OFFSET,
        LOAD,
        LOAD,
        code.len() as u64,
        memsz.max(code.len() as u64),
        0x1000,
    ] {
        img.extend_from_slice(&v.to_le_bytes());
    }
    img.resize(CODE_OFFSET as usize, 0);
    img.extend_from_slice(code);
    img
}

/// 64-bit code: write "ok\n" to COM1, then power off through port 0x600.
pub const HELLO_POWEROFF: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'o', 0xee, // mov al, 'o'; out dx, al
    0xb0, b'k', 0xee, // mov al, 'k'; out dx, al
    0xb0, b'\n', 0xee, // mov al, '\n'; out dx, al
    0x66, 0xba, 0x00, 0x06, // mov dx, 0x600
    0xb0, 0x34, 0xee, // mov al, (5 << 2) | (1 << 5); out dx, al
    0xf4, // hlt
];

/// 64-bit code: spin forever.
pub const SPIN: &[u8] = &[0xeb, 0xfe];

/// Writes `bytes` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The process's exit status and stderr, for assertions.
pub fn status_and_stderr(out: &Output) -> (Option<i32>, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A minimal bzImage: a boot sector plus one setup sector holding a Linux boot protocol
/// 2.15 setup header that declares a 64-bit entry (XLF_KERNEL_64), then a protected-mode
/// kernel whose 64-bit entry, at +0x200, is `code`.
pub fn tiny_bzimage(code: &[u8]) -> Vec<u8> {
    const SETUP_SECTS: u8 = 1;
    let mut img = vec![0u8; (usize::from(SETUP_SECTS) + 1) * 512];
    let mut put =
        |offset: usize, bytes: &[u8]| img[offset..offset + bytes.len()].copy_from_slice(bytes);
    put(0x1f1, &[SETUP_SECTS]);
    put(0x1fe, &0xaa55u16.to_le_bytes()); // boot_flag
    put(0x202, b"HdrS");
    put(0x206, &0x020fu16.to_le_bytes()); // version 2.15
    put(0x211, &[0x01]); // loadflags: LOADED_HIGH
    put(0x214, &0x10_0000u32.to_le_bytes()); // code32_start
    put(0x22c, &0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    put(0x236, &0x0001u16.to_le_bytes()); // xloadflags: XLF_KERNEL_64
    put(0x238, &4096u32.to_le_bytes()); // cmdline_size
    put(0x260, &0x10_0000u32.to_le_bytes()); // init_size: 1 MiB
    let mut kernel = vec![0xf4u8; 0x200]; // hlt: the 32-bit entry is never used
    kernel.extend_from_slice(code);
    img.extend_from_slice(&kernel);
    img
}
