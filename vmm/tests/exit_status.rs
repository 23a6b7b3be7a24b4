//! How the VM ends decides the process exit status (docs/vmm.md). Each case boots a few
//! bytes of 64-bit code on real KVM.

mod common;

use std::process::Stdio;

use common::{tiny_elf, vmm, write_file, HELLO_POWEROFF};

/// Runs `code` as a guest and returns its exit status and stdout.
fn run_guest(code: &[u8], extra: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "guest.elf", &tiny_elf(code, 0));
    let out = vmm()
        .args(["--kernel", kernel.to_str().unwrap(), "--memory-mib", "32"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn power_off_exits_0_after_serial_output() {
    if !common::kvm_available("power_off_exits_0_after_serial_output") {
        return;
    }
    let (status, stdout) = run_guest(HELLO_POWEROFF, &[]);
    assert_eq!(status, Some(0));
    assert_eq!(stdout, "ok\n");
}

#[test]
fn serial_file_output_is_appended() {
    if !common::kvm_available("serial_file_is_appended") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serial.log");
    std::fs::write(&log, "before\n").unwrap();
    let (status, _) = run_guest(
        HELLO_POWEROFF,
        &["--serial", &format!("file:{}", log.display())],
    );
    assert_eq!(status, Some(0));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "before\nok\n");
}

#[test]
fn i8042_reset_exits_3() {
    if !common::kvm_available("i8042_reset_exits_3") {
        return;
    }
    // mov al, 0xfe; out 0x64, al; hlt
    let (status, _) = run_guest(&[0xb0, 0xfe, 0xe6, 0x64, 0xf4], &[]);
    assert_eq!(status, Some(3));
}

#[test]
fn acpi_reset_exits_3() {
    if !common::kvm_available("acpi_reset_exits_3") {
        return;
    }
    // mov dx, 0x600; mov al, 1; out dx, al; hlt
    let (status, _) = run_guest(&[0x66, 0xba, 0x00, 0x06, 0xb0, 0x01, 0xee, 0xf4], &[]);
    assert_eq!(status, Some(3));
}

#[test]
fn triple_fault_exits_4() {
    if !common::kvm_available("triple_fault_exits_4") {
        return;
    }
    // ud2 with an empty IDT: #UD -> #GP -> #DF -> shutdown
    let (status, _) = run_guest(&[0x0f, 0x0b], &[]);
    assert_eq!(status, Some(4));
}

#[test]
fn pvpanic_exits_5() {
    if !common::kvm_available("pvpanic_exits_5") {
        return;
    }
    // mov dx, 0x505; mov al, 1; out dx, al; hlt
    let (status, _) = run_guest(&[0x66, 0xba, 0x05, 0x05, 0xb0, 0x01, 0xee, 0xf4], &[]);
    assert_eq!(status, Some(5));
}

#[test]
fn bzimage_64bit_entry_runs_and_powers_off() {
    if !common::kvm_available("bzimage_64bit_entry_runs_and_powers_off") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "bzImage", &common::tiny_bzimage(HELLO_POWEROFF));
    let out = vmm()
        .args(["--kernel", kernel.to_str().unwrap(), "--memory-mib", "32"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
}

#[test]
fn serial_input_from_stdin_reaches_the_guest() {
    if !common::kvm_available("serial_input_from_stdin_reaches_the_guest") {
        return;
    }
    // Echo loop: wait for LSR.DR, read RBR, write it back to THR; power off on '!'.
    #[rustfmt::skip]
    let echo: &[u8] = &[
        0x66, 0xba, 0xfd, 0x03,       // 0: mov dx, 0x3fd (LSR)
        0xec,                         // 4: in al, dx
        0xa8, 0x01,                   // 5: test al, 1
        0x74, 0xf7,                   // 7: jz 0
        0x66, 0xba, 0xf8, 0x03,       // 9: mov dx, 0x3f8
        0xec,                         // 13: in al, dx
        0xee,                         // 14: out dx, al
        0x3c, b'!',                   // 15: cmp al, '!'
        0x75, 0xed,                   // 17: jne 0
        0x66, 0xba, 0x00, 0x06,       // 19: mov dx, 0x600
        0xb0, 0x34, 0xee, 0xf4,       // 23: mov al, 0x34; out dx, al; hlt
    ];
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "echo.elf", &tiny_elf(echo, 0));
    let mut child = vmm()
        .args(["--kernel", kernel.to_str().unwrap(), "--memory-mib", "32"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let input: Vec<u8> = (0..300)
        .map(|i| b'a' + (i % 26) as u8)
        .chain(*b"!")
        .collect();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&input).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, input, "every byte echoed back in order");
}

#[test]
fn string_port_output_reaches_serial_byte_by_byte() {
    if !common::kvm_available("string_port_output_reaches_serial_byte_by_byte") {
        return;
    }
    #[rustfmt::skip]
    let code: &[u8] = &[
        0x48, 0x8d, 0x35, 0x13, 0x00, 0x00, 0x00, // lea rsi, [rip + 19] (the message)
        0xb9, 0x06, 0x00, 0x00, 0x00,             // mov ecx, 6
        0x66, 0xba, 0xf8, 0x03,                   // mov dx, 0x3f8
        0xf3, 0x6e,                               // rep outsb
        0x66, 0xba, 0x00, 0x06, 0xb0, 0x34, 0xee, 0xf4, // power off
        b'h', b'e', b'l', b'l', b'o', b'\n',
    ];
    let (status, stdout) = run_guest(code, &[]);
    assert_eq!(status, Some(0));
    assert_eq!(stdout, "hello\n");
}
