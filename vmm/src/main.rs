//! `tenantvm-vmm`: runs one KVM virtual machine and exits with a status that says how it
//! ended (docs/vmm.md).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{CommandFactory, FromArgMatches, Parser};
use tenantvm_vmm::api::config::load;
use tenantvm_vmm::api::{parse_disk, parse_vsock, VmConfig, VmConfigFile};
use tenantvm_vmm::report::ExitReporter;
use tenantvm_vmm_api::exit::help_table;
use tenantvm_vmm_api::{
    BootProtocol, ExitStatus, HugePages, PassthroughConfig, SeccompMode, SerialConfig, VmUuid,
    MAX_PASSTHROUGH_DEVICES,
};

/// Runs one tenant's virtual machine on KVM, one VM per process.
///
/// The guest's serial console (COM1) goes to stdout, a file, or nowhere; with stdout, the
/// VMM's stdin feeds the guest's serial input. The process ends when the VM does, and its
/// exit status says why (the table below).
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
    serial: Option<SerialConfig>,
    /// Control socket path (newline-delimited JSON: status, pause, resume, shutdown).
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Kernel entry point: auto (PVH if the ELF has the note), linux (64-bit boot
    /// protocol) or pvh [default: auto].
    #[arg(
        long,
        value_name = "PROTOCOL",
        value_parser = PossibleValuesParser::new(BootProtocol::NAMES).try_map(|s| s.parse::<BootProtocol>())
    )]
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
    #[arg(
        long,
        value_name = "on|log|off",
        value_parser = PossibleValuesParser::new(SeccompMode::NAMES).try_map(|s| s.parse::<SeccompMode>())
    )]
    seccomp: Option<SeccompMode>,
    /// A PCI device passed through over VFIO (repeatable, at most 8; PCI slot order after
    /// the virtio devices): a whole device or an SR-IOV virtual function bound to a VFIO
    /// driver, given by its sysfs directory. `,gpudirect_clique=N` (0-15, NVIDIA GPUs
    /// only) gives the guest NVIDIA's GPUDirect clique capability at config offset 0xD4.
    #[arg(
        long = "device",
        value_name = "vfio,path=/sys/bus/pci/devices/DDDD:BB:DD.F[,gpudirect_clique=N]"
    )]
    devices: Vec<String>,
    /// The VM's UUID; `-uuid UUID` (QEMU's spelling, which NVIDIA's vGPU manager looks for
    /// on the VMM's command line) is accepted too.
    #[arg(long, value_name = "UUID")]
    uuid: Option<VmUuid>,
    /// Write the exit report (exit status, each device's resets at attach and detach) to
    /// FILE as the VMM ends, atomically.
    #[arg(long, value_name = "FILE")]
    exit_report: Option<PathBuf>,
    /// Back the guest's RAM with huge pages of this size from the host's reserved pool
    /// (2M or 1G); the host must have enough free.
    #[arg(long, value_name = "2M|1G")]
    hugepages: Option<HugePages>,
    /// JSON file with the same fields (kernel, initramfs, cmdline, memory_mib, vcpus,
    /// serial, api_sock, boot, disks, vsock, rng, seccomp, devices, uuid, exit_report, hugepages);
    /// unknown fields are refused; flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the configuration (file and flags) without starting the VM or opening any of
    /// its files: print it as JSON with the defaults filled in and exit 0, or exit with
    /// the status a start would have (2, or 14 for zero vCPUs) and say what is wrong.
    #[arg(long)]
    check: bool,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

/// The `--device` values: passed-through devices, and (test builds only) the model GPU.
fn parse_devices(values: &[String]) -> Result<(Vec<PassthroughConfig>, usize), String> {
    let is_model = |v: &str| cfg!(feature = "test-model-gpu") && v == "model-gpu";
    let models = values.iter().filter(|v| is_model(v)).count();
    let devices = values
        .iter()
        .filter(|v| !is_model(v))
        .map(|v| v.parse::<PassthroughConfig>().map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    if devices.len() + models > MAX_PASSTHROUGH_DEVICES {
        return Err(format!(
            "{} --device flags; a VM takes at most {MAX_PASSTHROUGH_DEVICES}",
            devices.len() + models
        ));
    }
    Ok((devices, models))
}

fn fail(status: ExitStatus, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("tenantvm-vmm: {message}");
    ExitCode::from(status.code())
}

fn parse_cli() -> Result<Cli, clap::Error> {
    let command = Cli::command().after_help(format!("Exit statuses:\n{}", help_table()));
    // QEMU's spelling `-uuid` is accepted too: NVIDIA's vGPU manager looks for it on the
    // VMM's command line.
    let args = std::env::args_os().map(|a| if a == "-uuid" { "--uuid".into() } else { a });
    Cli::from_arg_matches(&command.try_get_matches_from(args)?)
}

fn main() -> ExitCode {
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(e) => {
            let status = if e.use_stderr() {
                ExitStatus::ConfigError.code()
            } else {
                0
            };
            // Printing help or the error can only fail on a closed stream.
            let _ = e.print();
            return ExitCode::from(status);
        }
    };
    let file = match &cli.config {
        Some(path) => match load(path) {
            Ok(file) => file,
            Err(e) => return fail(e.exit_status(), e),
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
        Err(e) => return fail(ExitStatus::ConfigError, e),
    };
    let vsock = match cli.vsock.as_deref().map(parse_vsock).transpose() {
        Ok(vsock) => vsock,
        Err(e) => return fail(ExitStatus::ConfigError, e),
    };
    let (devices, test_model_gpus) = match parse_devices(&cli.devices) {
        Ok(parsed) => parsed,
        Err(e) => return fail(ExitStatus::ConfigError, e),
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
        devices: (!devices.is_empty()).then_some(devices),
        uuid: cli.uuid,
        hugepages: cli.hugepages,
        exit_report: cli.exit_report,
    };
    let mut config = match VmConfig::resolve(file.overridden_by(flags)) {
        Ok(config) => config,
        Err(e) => return fail(e.exit_status(), e),
    };
    config.test_model_gpus = test_model_gpus;
    if config.devices.len() + test_model_gpus > MAX_PASSTHROUGH_DEVICES {
        return fail(
            ExitStatus::ConfigError,
            format!("More than {MAX_PASSTHROUGH_DEVICES} passed-through devices"),
        );
    }
    if cli.check {
        return match serde_json::to_string_pretty(&config) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(ExitStatus::ConfigError, e),
        };
    }
    let reporter = match config.exit_report.as_deref().map(ExitReporter::create) {
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => return fail(ExitStatus::ConfigError, e),
        None => None,
    };
    let reports = reporter
        .as_ref()
        .map(ExitReporter::devices)
        .unwrap_or_default();
    let (code, status) =
        match tenantvm_vmm::lifecycle::run_reporting(&config, reports, reporter.is_some()) {
            Ok(reason) => {
                let status = reason.exit_status();
                if status != ExitStatus::PowerOff {
                    eprintln!("tenantvm-vmm: {reason} (exit status {})", status.code());
                }
                (ExitCode::from(status.code()), status)
            }
            Err(e) => (fail(e.exit_status(), &e), e.exit_status()),
        };
    if let Some(reporter) = reporter {
        if let Err(e) = reporter.finish(status.code()) {
            eprintln!("tenantvm-vmm: {e}");
        }
    }
    code
}
