//! `tenantvm-vmm`: runs one KVM virtual machine and exits with a status that says how it
//! ended (docs/vmm.md).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tenantvm_vmm::api::{parse_disk, parse_vsock, VmConfig, VmConfigFile};
use tenantvm_vmm::boot::BootProtocol;

/// Runs one tenant's virtual machine on KVM, one VM per process.
///
/// The guest's serial console (COM1) goes to stdout, a file, or nowhere; with stdout, the
/// VMM's stdin feeds the guest's serial input. The process ends when the VM does, and its
/// exit status says why:
///
///   0  the guest powered off (ACPI sleep control port 0x600, S5)
///   1  VMM runtime error
///   2  usage or config error
///   3  the guest asked for a reset (i8042 0xFE, ACPI reset)
///   4  triple fault
///   5  the guest reported a crash (pvpanic, port 0x505)
///   6  stopped through the control socket
///   7  the guest could not be run (KVM internal error, failed entry)
///  10  kernel missing or unreadable
///  11  kernel is not a loadable ELF vmlinux or bzImage
///  12  initramfs missing, unreadable, or too large for guest memory
///  13  guest memory too small for the kernel
///  14  vCPU count is 0 or above what KVM allows
///  15  control socket path busy or not writable
///  16  /dev/kvm missing or not usable
///  17  serial output file cannot be opened
///  18  a disk image is missing, unreadable or unusable
///  19  the vsock socket path is busy, not a socket or not writable
///  20  a VMM thread made a system call its seccomp filter does not allow
///
/// Example:
///   tenantvm-vmm --kernel vmlinux --memory-mib 512 --vcpus 2 \
///       --cmdline "console=ttyS0" --api-sock /run/vm1.sock \
///       --disk path=/var/lib/vm1/disk.img --vsock cid=3,socket=/run/vm1.vsock
#[derive(Debug, Parser)]
#[command(name = "tenantvm-vmm", version, verbatim_doc_comment)]
struct Cli {
    /// Kernel image: an ELF vmlinux (PVH entry used when its note exists) or a bzImage.
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initramfs, placed at the top of low guest memory.
    #[arg(long, value_name = "PATH")]
    initramfs: Option<PathBuf>,
    /// Kernel command line [default: "console=ttyS0 reboot=k panic=1"].
    #[arg(long, value_name = "STR")]
    cmdline: Option<String>,
    /// Guest RAM in MiB [default: 128].
    #[arg(long, value_name = "N")]
    memory_mib: Option<u64>,
    /// Number of vCPUs; vCPU 0 boots, the others wait for INIT-SIPI-SIPI [default: 1].
    #[arg(long, value_name = "N")]
    vcpus: Option<u32>,
    /// Serial console output: stdout, file:PATH (appended to) or none [default: stdout].
    #[arg(long, value_name = "stdout|file:PATH|none")]
    serial: Option<String>,
    /// Control socket path (newline-delimited JSON: status, pause, resume, shutdown).
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Kernel entry point: auto (PVH if the ELF has the note), linux (64-bit boot
    /// protocol) or pvh [default: auto].
    #[arg(long, value_name = "PROTOCOL")]
    boot: Option<BootProtocol>,
    /// A virtio-blk disk (repeatable; PCI slot order): a raw image file, read-only with
    /// readonly=on, GET_ID serial id=, rate limits bps= (bytes/s) and iops=.
    #[arg(
        long = "disk",
        value_name = "path=PATH[,readonly=on][,id=ID][,bps=N][,iops=N]"
    )]
    disks: Vec<String>,
    /// A virtio-vsock device with guest CID N; host processes connect to the Unix socket
    /// PATH and write "CONNECT <port>\n"; guest connections to port P go to PATH_P.
    #[arg(long, value_name = "cid=N,socket=PATH")]
    vsock: Option<String>,
    /// A virtio-rng device fed from the host's getrandom [default: on].
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    rng: Option<bool>,
    /// Seccomp filters on every VMM thread: on (calls outside a thread's list end the
    /// process with status 20), log (allowed, logged by the kernel; for debugging), off
    /// [default: on].
    #[arg(long, value_name = "on|log|off")]
    seccomp: Option<tenantvm_vmm::seccomp::SeccompMode>,
    /// JSON file with the same fields (kernel, initramfs, cmdline, memory_mib, vcpus,
    /// serial, api_sock, boot, disks, vsock, rng, seccomp); unknown fields are refused;
    /// flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

fn fail(status: u8, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("tenantvm-vmm: {message}");
    ExitCode::from(status)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let status = if e.use_stderr() { 2 } else { 0 };
            // Printing help or the error can only fail on a closed stream.
            let _ = e.print();
            return ExitCode::from(status);
        }
    };
    let file = match &cli.config {
        Some(path) => match VmConfigFile::load(path) {
            Ok(file) => file,
            Err(e) => return fail(e.exit_status() as u8, e),
        },
        None => VmConfigFile::default(),
    };
    let disks = match cli
        .disks
        .iter()
        .map(|d| parse_disk(d))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(disks) => (!disks.is_empty()).then_some(disks),
        Err(e) => return fail(2, e),
    };
    let vsock = match cli.vsock.as_deref().map(parse_vsock).transpose() {
        Ok(vsock) => vsock,
        Err(e) => return fail(2, e),
    };
    let flags = VmConfigFile {
        kernel: cli.kernel,
        initramfs: cli.initramfs,
        cmdline: cli.cmdline,
        memory_mib: cli.memory_mib,
        vcpus: cli.vcpus,
        serial: cli.serial,
        api_sock: cli.api_sock,
        boot: cli.boot,
        disks,
        vsock,
        rng: cli.rng,
        seccomp: cli.seccomp,
    };
    let config = match VmConfig::resolve(file.overridden_by(flags)) {
        Ok(config) => config,
        Err(e) => return fail(e.exit_status() as u8, e),
    };
    match tenantvm_vmm::run(&config) {
        Ok(reason) => {
            let status = reason.exit_status();
            if status != 0 {
                eprintln!("tenantvm-vmm: {reason} (exit status {status})");
            }
            ExitCode::from(status as u8)
        }
        Err(e) => fail(e.exit_status() as u8, e),
    }
}
