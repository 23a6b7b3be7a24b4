//! The device allowance of a tenant's cgroup: the VMM (and every process of its jail) may
//! create, read and write exactly the character devices its jail plan lists (`/dev/kvm`,
//! `/dev/null`, `/dev/urandom`, and for a GPU tenant its IOMMU group's `/dev/vfio/<group>`
//! and `/dev/vfio/vfio`), and no other device, even one it could reach some other way.
//!
//! cgroup v1: the `devices` controller, `devices.deny` = `a`, then one `c MAJ:MIN rwm` line
//! per device in `devices.allow`, read back from `devices.list`. cgroup v2 has no device
//! files: a `BPF_PROG_TYPE_CGROUP_DEVICE` program that allows exactly those (type, major,
//! minor) triples is loaded and attached to the cgroup (`BPF_CGROUP_DEVICE`; it replaces a
//! program an earlier launch attached). A host without either gets no allowance, and the
//! outcome says why (the jail's own device nodes still limit what the VMM can open).

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cgroup::{write_file, CgroupHandle};
use super::JailError;

/// What [`CgroupHandle::allow_only_devices`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum DeviceAllowance {
    /// Only these devices (`c MAJ:MIN`) may be used in the cgroup.
    Applied {
        /// `v1 devices` or `v2 bpf`.
        controller: String,
        /// The allowed devices, `c MAJ:MIN`.
        devices: Vec<String>,
    },
    /// No allowance could be set; why.
    NotApplied {
        /// Why.
        reason: String,
    },
}

/// A character device's (major, minor).
pub fn char_device_numbers(path: &Path) -> Result<(u32, u32), JailError> {
    let meta = fs::metadata(path).map_err(|source| JailError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_char_device() {
        return Err(JailError::InvalidPlan(format!(
            "{} is not a character device",
            path.display()
        )));
    }
    let rdev = meta.rdev();
    Ok((libc::major(rdev), libc::minor(rdev)))
}

impl CgroupHandle {
    /// Lets the cgroup's processes use only `nodes` (character devices, host paths).
    /// Call it on the new, empty cgroup, before the launcher joins it.
    pub fn allow_only_devices(&self, nodes: &[PathBuf]) -> Result<DeviceAllowance, JailError> {
        let mut numbers = Vec::new();
        for node in nodes {
            let n = char_device_numbers(node)?;
            if !numbers.contains(&n) {
                numbers.push(n);
            }
        }
        let lines: Vec<String> = numbers
            .iter()
            .map(|(major, minor)| format!("c {major}:{minor}"))
            .collect();
        match self {
            CgroupHandle::V1 { devices: None, .. } => Ok(DeviceAllowance::NotApplied {
                reason: "no cgroup v1 devices controller is mounted on this host".into(),
            }),
            CgroupHandle::V1 {
                devices: Some(dir), ..
            } => {
                allow_v1(dir, &lines)?;
                Ok(DeviceAllowance::Applied {
                    controller: "v1 devices".into(),
                    devices: lines,
                })
            }
            CgroupHandle::V2 { path } => {
                let program = bpf::device_program(&numbers);
                bpf::load_and_attach(path, &program)?;
                Ok(DeviceAllowance::Applied {
                    controller: "v2 bpf".into(),
                    devices: lines,
                })
            }
        }
    }
}

/// v1: deny all, allow each, and check `devices.list` says exactly that.
fn allow_v1(dir: &Path, lines: &[String]) -> Result<(), JailError> {
    write_file(&dir.join("devices.deny"), "a")?;
    for line in lines {
        write_file(&dir.join("devices.allow"), &format!("{line} rwm"))?;
    }
    let list = dir.join("devices.list");
    let text = fs::read_to_string(&list).map_err(|source| JailError::Io {
        path: list.clone(),
        source,
    })?;
    let mut have: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut want: Vec<String> = lines.iter().map(|l| format!("{l} rwm")).collect();
    have.sort_unstable();
    want.sort_unstable();
    if have != want {
        return Err(JailError::CgroupUnavailable(format!(
            "{} lists {have:?} after allowing only {want:?}; the parent cgroup may not allow these devices",
            list.display()
        )));
    }
    Ok(())
}

/// The cgroup v2 device program.
pub mod bpf {
    use super::*;

    /// `BPF_DEVCG_DEV_CHAR`: the device type of a character device in the program's context.
    pub const DEV_CHAR: i32 = 2;
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_ATTACH: libc::c_long = 8;
    const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
    const BPF_CGROUP_DEVICE: u32 = 6;

    /// One eBPF instruction (`struct bpf_insn`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(C)]
    pub struct Insn {
        /// Opcode.
        pub code: u8,
        /// Destination register (low nibble) and source register (high nibble).
        pub regs: u8,
        /// Offset.
        pub off: i16,
        /// Immediate.
        pub imm: i32,
    }

    const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            code,
            regs: (src << 4) | dst,
            off,
            imm,
        }
    }

    /// `rD = *(u32 *)(r1 + off)`.
    const fn load_ctx(dst: u8, off: i16) -> Insn {
        insn(0x61, dst, 1, off, 0)
    }
    /// `if rD != imm goto +off`.
    const fn jne(dst: u8, imm: i32, off: i16) -> Insn {
        insn(0x55, dst, 0, off, imm)
    }
    /// `r0 = imm`.
    const fn ret(imm: i32) -> [Insn; 2] {
        [insn(0xb7, 0, 0, 0, imm), insn(0x95, 0, 0, 0, 0)]
    }

    /// The program: allow (return 1) a character device whose (major, minor) is listed,
    /// any access; deny (return 0) everything else. Context `struct bpf_cgroup_dev_ctx`:
    /// `access_type` (access << 16 | type), `major`, `minor`, each a u32.
    pub fn device_program(allowed: &[(u32, u32)]) -> Vec<Insn> {
        let mut p = vec![
            load_ctx(2, 0),
            // r2 &= 0xffff: the device type.
            insn(0x57, 2, 0, 0, 0xffff),
            load_ctx(3, 4),
            load_ctx(4, 8),
        ];
        for &(major, minor) in allowed {
            // Majors and minors fit in 12 and 20 bits: never negative as i32.
            p.push(jne(2, DEV_CHAR, 4));
            p.push(jne(3, major as i32, 3));
            p.push(jne(4, minor as i32, 2));
            p.extend(ret(1));
        }
        p.extend(ret(0));
        p
    }

    /// `union bpf_attr` for `BPF_PROG_LOAD` (the fields used; the rest zero).
    #[repr(C)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        rest: [u8; 88],
    }

    /// `union bpf_attr` for `BPF_PROG_ATTACH`.
    #[repr(C)]
    struct ProgAttach {
        target_fd: u32,
        attach_bpf_fd: u32,
        attach_type: u32,
        attach_flags: u32,
        rest: [u8; 112],
    }

    /// Loads `program` and attaches it to the cgroup directory `cgroup` (replacing the
    /// program an earlier launch attached there). Needs CAP_SYS_ADMIN (CAP_BPF).
    pub fn load_and_attach(cgroup: &Path, program: &[Insn]) -> Result<(), JailError> {
        let license = c"GPL";
        let mut log = vec![0u8; 4096];
        let attr = ProgLoad {
            prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
            insn_cnt: u32::try_from(program.len()).unwrap_or(u32::MAX),
            insns: program.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 1,
            log_size: log.len() as u32,
            log_buf: log.as_mut_ptr() as u64,
            kern_version: 0,
            prog_flags: 0,
            rest: [0; 88],
        };
        // SAFETY: bpf(2) BPF_PROG_LOAD with a fully initialised attr whose pointers (the
        // instructions, the license string, the log buffer) outlive the call and whose sizes
        // match; the kernel writes only into the log buffer.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_LOAD,
                &attr as *const ProgLoad,
                std::mem::size_of::<ProgLoad>(),
            )
        };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            let text = String::from_utf8_lossy(&log);
            return Err(JailError::CgroupUnavailable(format!(
                "cannot load the cgroup v2 device program ({err}): {}",
                text.trim_end_matches('\0').trim()
            )));
        }
        // SAFETY: a new file descriptor bpf(2) just returned; owned from here on.
        let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let dir = fs::File::open(cgroup).map_err(|source| JailError::Io {
            path: cgroup.to_path_buf(),
            source,
        })?;
        let attach = ProgAttach {
            target_fd: dir.as_raw_fd() as u32,
            attach_bpf_fd: prog.as_raw_fd() as u32,
            attach_type: BPF_CGROUP_DEVICE,
            attach_flags: 0,
            rest: [0; 112],
        };
        // SAFETY: bpf(2) BPF_PROG_ATTACH with a fully initialised attr naming two open file
        // descriptors we own; the kernel reads the attr only.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_ATTACH,
                &attach as *const ProgAttach,
                std::mem::size_of::<ProgAttach>(),
            )
        };
        if r < 0 {
            return Err(JailError::CgroupUnavailable(format!(
                "cannot attach the device program to {}: {}",
                cgroup.display(),
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program the way the kernel would, on one access.
    fn run(program: &[bpf::Insn], dev_type: u32, major: u32, minor: u32) -> i64 {
        let ctx = [(2u32 << 16) | dev_type, major, minor];
        let mut r = [0i64; 11];
        let mut pc = 0usize;
        loop {
            let i = program[pc];
            let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
            pc += 1;
            match i.code {
                0x61 => {
                    assert_eq!(src, 1);
                    r[dst] = i64::from(ctx[(i.off / 4) as usize]);
                }
                0x57 => r[dst] &= i64::from(i.imm),
                0x55 => {
                    if r[dst] != i64::from(i.imm) {
                        pc = (pc as i64 + i64::from(i.off)) as usize;
                    }
                }
                0xb7 => r[dst] = i64::from(i.imm),
                0x95 => return r[0],
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    #[test]
    fn the_v2_program_allows_exactly_the_listed_character_devices() {
        let program = bpf::device_program(&[(10, 232), (243, 17), (1, 3)]);
        assert_eq!(run(&program, 2, 10, 232), 1);
        assert_eq!(run(&program, 2, 243, 17), 1);
        assert_eq!(run(&program, 2, 1, 3), 1);
        // Another group of the same major, another minor, a block device, nothing listed.
        assert_eq!(run(&program, 2, 243, 18), 0);
        assert_eq!(run(&program, 2, 1, 5), 0);
        assert_eq!(run(&program, 1, 10, 232), 0);
        assert_eq!(run(&bpf::device_program(&[]), 2, 1, 3), 0);
    }

    #[test]
    fn v1_allows_only_the_plan_devices_and_checks_the_list() {
        // A fake v1 directory: writes land in the files; devices.list says what the kernel
        // would.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("devices/tenantvm/t");
        fs::create_dir_all(&dir).unwrap();
        let handle = CgroupHandle::V1 {
            memory: tmp.path().join("m"),
            cpu: tmp.path().join("c"),
            pids: tmp.path().join("p"),
            blkio: None,
            devices: Some(dir.clone()),
            cpuacct: None,
        };
        fs::write(dir.join("devices.list"), "c 1:3 rwm\nc 1:9 rwm\n").unwrap();
        let out = handle
            .allow_only_devices(&[PathBuf::from("/dev/null"), PathBuf::from("/dev/urandom")])
            .unwrap();
        assert_eq!(
            out,
            DeviceAllowance::Applied {
                controller: "v1 devices".into(),
                devices: vec!["c 1:3".into(), "c 1:9".into()],
            }
        );
        assert_eq!(fs::read_to_string(dir.join("devices.deny")).unwrap(), "a");
        // A list that does not match (the parent withholds a device) is an error.
        fs::write(dir.join("devices.list"), "a *:* rwm\n").unwrap();
        handle
            .allow_only_devices(&[PathBuf::from("/dev/null")])
            .unwrap_err();
        // Not a character device.
        assert!(matches!(
            handle.allow_only_devices(&[PathBuf::from("/bin/sh")]),
            Err(JailError::InvalidPlan(_))
        ));
        let none = CgroupHandle::V1 {
            memory: tmp.path().join("m"),
            cpu: tmp.path().join("c"),
            pids: tmp.path().join("p"),
            blkio: None,
            devices: None,
            cpuacct: None,
        };
        assert!(matches!(
            none.allow_only_devices(&[PathBuf::from("/dev/null")])
                .unwrap(),
            DeviceAllowance::NotApplied { .. }
        ));
    }

    /// Whether a shell moved into the cgroup at `procs` can open `node`.
    fn can_open_in(procs: &Path, node: &str) -> bool {
        std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec head -c1 {node} > /dev/null 2>&1 < /dev/null",
                procs.display()
            ))
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Checks the allowance on the real kernel: /dev/zero (not listed) is refused,
    /// /dev/null and /dev/urandom are not.
    fn check_real(handle: &CgroupHandle, procs: &Path) {
        let nodes = [PathBuf::from("/dev/null"), PathBuf::from("/dev/urandom")];
        let out = handle.allow_only_devices(&nodes).unwrap();
        assert!(matches!(out, DeviceAllowance::Applied { .. }), "{out:?}");
        assert!(can_open_in(procs, "/dev/urandom"));
        assert!(!can_open_in(procs, "/dev/zero"));
    }

    #[test]
    fn the_kernel_refuses_unlisted_devices_in_the_cgroup() {
        if !nix::unistd::geteuid().is_root() {
            tenantvm_skip::skip!("needs root (cgroups, bpf)");
        }
        let name = format!("tenantvm-devtest-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/devices");
        let v2 = Path::new("/sys/fs/cgroup/unified");
        let mut ran = false;
        if v1.join("devices.allow").exists() {
            let dir = v1.join(&name);
            fs::create_dir(&dir).unwrap();
            let handle = CgroupHandle::V1 {
                memory: dir.clone(),
                cpu: dir.clone(),
                pids: dir.clone(),
                blkio: None,
                devices: Some(dir.clone()),
                cpuacct: None,
            };
            check_real(&handle, &dir.join("cgroup.procs"));
            let _ = fs::remove_dir(&dir);
            ran = true;
        }
        let v2 = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            Path::new("/sys/fs/cgroup")
        } else {
            v2
        };
        if v2.join("cgroup.procs").exists() {
            let dir = v2.join(&name);
            fs::create_dir(&dir).unwrap();
            let handle = CgroupHandle::V2 { path: dir.clone() };
            check_real(&handle, &dir.join("cgroup.procs"));
            let _ = fs::remove_dir(&dir);
            ran = true;
        }
        if !ran {
            tenantvm_skip::skip!("neither a v1 devices controller nor a cgroup v2 mount");
        }
    }
}
