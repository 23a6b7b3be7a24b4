//! The VM's life: build it from a validated config, run it, carry out control-socket
//! commands, and stop every vCPU when it ends.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tenantvm_devices::legacy::{spawn_input_thread, SerialOutput};
use tenantvm_devices::pci::{PciWindows, MMIO64_DEFAULT_SIZE};
use tenantvm_devices::virtio::block::{Block, BlockError};
use tenantvm_devices::virtio::rng::Rng;
use tenantvm_devices::virtio::vsock::{Vsock, VsockError};
use tenantvm_devices::virtio::ThreadInit;
use tenantvm_vmm_api::{DeviceReport, ExitStatus};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::api::server::ConnectionState;
use crate::api::{ApiError, ApiServer, SerialConfig, VmCommand, VmConfig, VmResponse, VmState};
use crate::boot::{self, BootConfig, BootError};
use crate::device_manager::{attach_legacy_devices, DeviceManagerError};
use crate::exit::{ExitReason, ExitState};
use crate::pci::vfio::{guest_phys_bits, DeviceSource, Passthrough, PassthroughError};
use crate::pci::{host_bridge, DeviceCounters, PciPlatform, PciSetupError};
use crate::seccomp::{install_sigsys_handler, FilterExtras, Filters, SeccompError, ThreadKind};
use crate::terminal::RawTerminal;
use crate::vstate::cpuid::set_cpuid_phys_bits;
use crate::vstate::vcpu::{self, Buses, VcpuSet};
use crate::vstate::vm::{create_guest_memory, Vm};
use crate::vstate::VstateError;

/// Why the VM could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Loading the kernel, initramfs or boot structures failed.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// KVM could not be set up.
    #[error(transparent)]
    Vstate(#[from] VstateError),
    /// The control socket could not be set up.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// Devices could not be attached.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// The serial output file cannot be opened.
    #[error("Cannot open serial output file {}: {source}; check the path and its permissions", path.display())]
    SerialFile {
        /// The path given.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A host resource (eventfd, epoll, thread) could not be created.
    #[error("Host resource unavailable: {0}")]
    Host(#[source] std::io::Error),
    /// The PCI platform or a device on it could not be set up.
    #[error(transparent)]
    Pci(#[from] PciSetupError),
    /// A disk image cannot be used.
    #[error("Cannot use disk {index} ({}): {source}", path.display())]
    Disk {
        /// Position of the disk on the command line / in the config.
        index: usize,
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        source: BlockError,
    },
    /// The vsock socket cannot be used.
    #[error("Cannot set up vsock: {0}")]
    Vsock(#[source] VsockError),
    /// The seccomp filters could not be built or installed.
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    /// A passed-through device could not be attached.
    #[error(transparent)]
    Passthrough(#[from] PassthroughError),
}

impl StartError {
    /// The process exit status documented in docs/vmm.md.
    pub fn exit_status(&self) -> ExitStatus {
        match self {
            StartError::Boot(e) => match e {
                BootError::KernelOpen { .. } => ExitStatus::KernelUnreadable,
                BootError::KernelFormat(_) => ExitStatus::KernelFormat,
                BootError::InitramfsOpen { .. } | BootError::InitramfsTooLarge { .. } => {
                    ExitStatus::Initramfs
                }
                BootError::MemoryTooSmall { .. } => ExitStatus::MemoryTooSmall,
                BootError::TooManyCpus { .. } => ExitStatus::VcpuCount,
                BootError::Cmdline(_) => ExitStatus::ConfigError,
                BootError::Internal(_) => ExitStatus::VmmError,
            },
            StartError::Vstate(e) => match e {
                VstateError::KvmUnavailable(_) => ExitStatus::KvmUnavailable,
                VstateError::TooManyVcpus { .. } => ExitStatus::VcpuCount,
                _ => ExitStatus::VmmError,
            },
            StartError::Api(_) => ExitStatus::ApiSocket,
            StartError::SerialFile { .. } => ExitStatus::SerialFile,
            StartError::Pci(PciSetupError::Windows(_)) => ExitStatus::ConfigError,
            StartError::Disk { .. } => ExitStatus::DiskImage,
            StartError::Vsock(_) => ExitStatus::VsockSocket,
            StartError::Passthrough(e) => e.exit_status(),
            StartError::Devices(_)
            | StartError::Host(_)
            | StartError::Pci(_)
            | StartError::Seccomp(_) => ExitStatus::VmmError,
        }
    }
}

const EXIT_TOKEN: u64 = u64::MAX;
const LISTENER_TOKEN: u64 = u64::MAX - 1;

/// Builds the VM described by `config`, runs it until it ends, and returns why it ended.
pub fn run(config: &VmConfig) -> Result<ExitReason, StartError> {
    run_reporting(config, Arc::default(), false)
}

/// Where kernel VFIO's device files are: `vfio/` (container, groups, `devices/` cdevs) and
/// `iommu` (iommufd).
const DEV_DIR: &str = "/dev";

/// The passed-through devices of `config`, in slot order.
fn device_sources(config: &VmConfig) -> Vec<DeviceSource> {
    let mut sources: Vec<DeviceSource> = config
        .devices
        .iter()
        .map(|d| DeviceSource::Kernel(d.clone()))
        .collect();
    sources.extend(std::iter::repeat_n(
        DeviceSource::Model,
        config.test_model_gpus,
    ));
    sources
}

/// [`run`], recording each passed-through device's resets in `reports` as they happen
/// (the exit report); `exit_report` says the main thread renames the report at the end.
pub fn run_reporting(
    config: &VmConfig,
    reports: Arc<Mutex<Vec<DeviceReport>>>,
    exit_report: bool,
) -> Result<ExitReason, StartError> {
    let sources = device_sources(config);
    let extras = FilterExtras {
        vfio: !sources.is_empty(),
        exit_report,
    };
    // Compiled before anything else, so that a filter that cannot be built stops the VMM
    // before it opens a single guest file.
    let filters = Filters::build_for(config.seccomp, extras)?.map(Arc::new);
    if filters.is_some() {
        install_sigsys_handler()?;
    }
    let serial_output = match &config.serial {
        SerialConfig::Stdout => SerialOutput::Stdout,
        SerialConfig::None => SerialOutput::Sink,
        SerialConfig::File(path) => SerialOutput::File(
            OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .map_err(|source| StartError::SerialFile {
                    path: path.clone(),
                    source,
                })?,
        ),
    };
    let mut api = config
        .api_sock
        .as_deref()
        .map(ApiServer::bind)
        .transpose()?;

    let mem_size = config.memory_mib << 20;
    let ram_end = boot::layout::ram_ranges(mem_size)
        .last()
        .map_or(0, |(start, len)| start + len);
    let mem = create_guest_memory(mem_size, config.hugepages)?;
    let vm = Arc::new(Vm::new(&mem)?);
    if config.vcpus > vm.max_vcpus() {
        return Err(VstateError::TooManyVcpus {
            requested: config.vcpus,
            max: vm.max_vcpus(),
        }
        .into());
    }
    // Then the devices, with the VM already there (each group or cdev goes to its KVM VFIO
    // device before the device is opened): they are reset and probed, and their BARs size
    // the 64-bit window the boot tables describe.
    let mut passthrough = Passthrough::open(&sources, Path::new(DEV_DIR), reports, vm.fd())?;
    let phys_bits = guest_phys_bits();
    let windows = if passthrough.is_empty() {
        PciWindows::new(ram_end, phys_bits, MMIO64_DEFAULT_SIZE).map_err(PciSetupError::from)?
    } else {
        passthrough.windows(ram_end, phys_bits)?
    };
    let entry = boot::load(
        &mem,
        &BootConfig {
            kernel: &config.kernel,
            initramfs: config.initramfs.as_deref(),
            cmdline: &config.cmdline,
            protocol: config.boot,
            vcpus: config.vcpus,
            mem_size,
            pci: Some(host_bridge(&windows)),
        },
    )?;

    let exit = Arc::new(ExitState::new().map_err(StartError::Host)?);
    let mut buses = Buses::default();
    let serial = attach_legacy_devices(
        &vm,
        &mut buses.pio,
        serial_output,
        exit.clone(),
        thread_init(&filters, ThreadKind::SerialOutput),
    )?;
    let serial_flush = serial
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .output_flush();
    let mut pci = PciPlatform::new(
        vm.clone(),
        mem.clone(),
        windows,
        &mut buses.pio,
        buses.mmio.clone(),
        thread_init(&filters, ThreadKind::Device),
    )?;
    attach_virtio_devices(&mut pci, config)?;
    pci.add_passthrough(&mut passthrough)?;
    let counters = pci.take_counters();
    // The guest sees the physical address width the PCI windows were planned for.
    let mut cpuid = vm.supported_cpuid().clone();
    set_cpuid_phys_bits(&mut cpuid, phys_bits);
    let mut fds = Vec::with_capacity(config.vcpus as usize);
    for id in 0..config.vcpus {
        let fd = vm.create_vcpu(id)?;
        vcpu::configure(&fd, id, config.vcpus, &cpuid, &mem, entry)?;
        fds.push(fd);
    }
    // Restored when `run` returns, on every path out of the running VM.
    let mut _raw_terminal = None;
    if config.serial == SerialConfig::Stdout {
        _raw_terminal = RawTerminal::enable(libc::STDIN_FILENO);
        spawn_input_thread(
            serial,
            Box::new(std::io::stdin()),
            thread_init(&filters, ThreadKind::SerialInput),
        )
        .map_err(|e| StartError::Devices(e.into()))?;
    }

    let epoll = Epoll::new().map_err(StartError::Host)?;
    epoll
        .ctl(
            ControlOperation::Add,
            exit.event().as_raw_fd(),
            EpollEvent::new(EventSet::IN, EXIT_TOKEN),
        )
        .map_err(StartError::Host)?;
    if let Some(api) = &api {
        epoll
            .ctl(
                ControlOperation::Add,
                api.listener_fd(),
                EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
            )
            .map_err(StartError::Host)?;
    }

    vcpu::install_kick_handler()?;
    let started = Instant::now();
    let vcpus = VcpuSet::start(fds, Arc::new(buses), exit.clone(), filters.clone())?;
    // The main thread's own filter goes on once it has started every thread it will.
    if let Some(filters) = &filters {
        if let Err(e) = filters.apply(ThreadKind::Main) {
            vcpus.stop();
            return Err(e.into());
        }
    }
    let reason = event_loop(
        &epoll,
        api.as_mut(),
        &vcpus,
        &exit,
        config,
        started,
        &counters,
    );
    vcpus.stop();
    // The guest's last console bytes (a line without its newline) go out before exit.
    if let Some(flush) = &serial_flush {
        flush.flush_now();
    }
    // Devices are reset once no vCPU can touch them, before their mappings go.
    passthrough.detach();
    // The device thread stops after the vCPUs, so no notification is left unserved.
    drop(pci);
    drop(api);
    Ok(reason)
}

/// The start-up hook that installs `kind`'s seccomp filter on a new thread.
fn thread_init(filters: &Option<Arc<Filters>>, kind: ThreadKind) -> Option<ThreadInit> {
    let filters = filters.clone()?;
    Some(Box::new(move || {
        filters.apply(kind).map_err(|e| e.to_string())
    }))
}

/// Serves the control socket until an exit reason is recorded, and returns it.
fn event_loop(
    epoll: &Epoll,
    mut api: Option<&mut ApiServer>,
    vcpus: &VcpuSet,
    exit: &ExitState,
    config: &VmConfig,
    started: Instant,
    counters: &DeviceCounters,
) -> ExitReason {
    let mut paused = false;
    let mut events = vec![EpollEvent::default(); 32];
    loop {
        if let Some(reason) = exit.reason() {
            break reason;
        }
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break ExitReason::vmm_error(format!("epoll_wait failed: {e}")),
        };
        for event in &events[..n] {
            match event.data() {
                EXIT_TOKEN => {}
                LISTENER_TOKEN => {
                    let Some(api) = api.as_deref_mut() else {
                        continue;
                    };
                    for fd in api.accept() {
                        let watch = EpollEvent::new(EventSet::IN, fd as u64);
                        if epoll.ctl(ControlOperation::Add, fd, watch).is_err() {
                            // A connection that cannot be watched could never be served.
                            api.close(fd);
                        }
                    }
                }
                token => {
                    let Some(api) = api.as_deref_mut() else {
                        continue;
                    };
                    let fd = token as i32;
                    let state = api.handle_readable(fd, |command| {
                        handle_command(command, vcpus, &mut paused, config, started, exit, counters)
                    });
                    if state == ConnectionState::Closed {
                        // Failing to unwatch is harmless: closing the fd unwatches it too.
                        let _ = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
                        api.close(fd);
                    }
                }
            }
        }
    }
}

/// Plugs the configured disks, vsock and rng into the PCI root, in that slot order.
fn attach_virtio_devices(pci: &mut PciPlatform, config: &VmConfig) -> Result<(), StartError> {
    for (index, disk) in config.disks.iter().enumerate() {
        let block = Block::new(disk).map_err(|source| StartError::Disk {
            index,
            path: disk.path.clone(),
            source,
        })?;
        let metrics = block.metrics();
        pci.add_virtio(
            &format!("disk{index}"),
            Box::new(block),
            Box::new(move || metrics.snapshot()),
        )?;
    }
    if let Some(vsock) = &config.vsock {
        let vsock = Vsock::new(vsock).map_err(StartError::Vsock)?;
        let metrics = vsock.metrics();
        pci.add_virtio(
            "vsock",
            Box::new(vsock),
            Box::new(move || metrics.snapshot()),
        )?;
    }
    if config.rng {
        let rng = Rng::new();
        let metrics = rng.metrics();
        pci.add_virtio("rng", Box::new(rng), Box::new(move || metrics.snapshot()))?;
    }
    Ok(())
}

fn handle_command(
    command: VmCommand,
    vcpus: &VcpuSet,
    paused: &mut bool,
    config: &VmConfig,
    started: Instant,
    exit: &ExitState,
    counters: &DeviceCounters,
) -> VmResponse {
    let state = |paused: bool| {
        if paused {
            VmState::Paused
        } else {
            VmState::Running
        }
    };
    match command {
        VmCommand::Status => VmResponse::Status {
            ok: true,
            state: state(*paused),
            vcpus: config.vcpus,
            memory_mib: config.memory_mib,
            uptime_ms: started.elapsed().as_millis() as u64,
            pid: std::process::id(),
        },
        VmCommand::Pause => {
            if !*paused {
                if let Err(e) = vcpus.pause() {
                    return VmResponse::error(e.to_string());
                }
                *paused = true;
            }
            VmResponse::Done {
                ok: true,
                state: VmState::Paused,
            }
        }
        VmCommand::Resume => {
            if *paused {
                vcpus.resume();
                *paused = false;
            }
            VmResponse::Done {
                ok: true,
                state: VmState::Running,
            }
        }
        VmCommand::Metrics => VmResponse::Metrics {
            ok: true,
            devices: counters.snapshot(),
        },
        VmCommand::Shutdown => {
            exit.stop(ExitReason::API_SHUTDOWN);
            VmResponse::Done {
                ok: true,
                state: state(*paused),
            }
        }
    }
}
