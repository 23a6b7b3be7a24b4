//! Application processors wait for INIT-SIPI-SIPI: only the BSP runs at start, and an AP
//! runs real-mode code at the SIPI vector once the BSP sends it, as on real hardware.

mod common;

use std::process::Stdio;

use common::{tiny_elf, vmm, write_file};

/// AP code (16-bit real mode, copied to 0x8000): print 'A', set the byte at 0x7f00, halt.
const AP_CODE: [u8; 16] = [
    0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'A', // mov al, 'A'
    0xee, // out dx, al
    0xc6, 0x06, 0x00, 0x7f, 0x01, // mov byte [0x7f00], 1
    0xfa, // cli
    0xf4, // hlt
    0xeb, 0xfd, // jmp hlt
    0x90,
];

/// BSP code (64-bit): copy AP_CODE to 0x8000, print 'B', INIT + SIPI(0x08) to APIC id
/// `target`, wait for the AP's flag, power off.
fn bsp_code(target: u8) -> Vec<u8> {
    let mut c = Vec::new();
    for (i, half) in AP_CODE.chunks(8).enumerate() {
        c.extend_from_slice(&[0x48, 0xb8]); // mov rax, imm64
        c.extend_from_slice(half);
        c.extend_from_slice(&[0x48, 0x89, 0x04, 0x25]); // mov [disp32], rax
        c.extend_from_slice(&(0x8000u32 + 8 * i as u32).to_le_bytes());
    }
    c.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xb0, b'B', 0xee]); // print 'B'
    c.extend_from_slice(&[0xbb, 0x00, 0x00, 0xe0, 0xfe]); // mov ebx, 0xfee00000
    let icr = |c: &mut Vec<u8>, high: u32, low: u32| {
        c.extend_from_slice(&[0xc7, 0x83, 0x10, 0x03, 0x00, 0x00]); // mov dword [rbx+0x310]
        c.extend_from_slice(&high.to_le_bytes());
        c.extend_from_slice(&[0xc7, 0x83, 0x00, 0x03, 0x00, 0x00]); // mov dword [rbx+0x300]
        c.extend_from_slice(&low.to_le_bytes());
    };
    icr(&mut c, u32::from(target) << 24, 0x0000_4500); // INIT, assert
    icr(&mut c, u32::from(target) << 24, 0x0000_4608); // SIPI, vector 0x08 -> 0x8000
    icr(&mut c, u32::from(target) << 24, 0x0000_4608); // second SIPI, as the MP spec says
    c.extend_from_slice(&[0x80, 0x3c, 0x25, 0x00, 0x7f, 0x00, 0x00, 0x01]); // cmp byte [0x7f00], 1
    c.extend_from_slice(&[0x75, 0xf6]); // jne back to cmp
    c.extend_from_slice(&[0x66, 0xba, 0x00, 0x06, 0xb0, 0x34, 0xee, 0xf4]); // power off
    c
}

#[test]
fn ap_starts_only_after_init_sipi_sipi() {
    if !common::kvm_available("ap_starts_only_after_init_sipi_sipi") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "smp.elf", &tiny_elf(&bsp_code(3), 0));
    let out = vmm()
        .args([
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory-mib",
            "32",
            "--vcpus",
            "4",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 'B' comes first: the AP did not run before the BSP woke it; exactly one AP ran.
    assert_eq!(String::from_utf8_lossy(&out.stdout), "BA");
}
