//! Seccomp filters: one allowlist per kind of VMM thread, installed by each thread on
//! itself once its set-up is done and before it touches anything the guest controls.
//!
//! A guest that takes over a thread of this process (through a device model bug, say)
//! can then only make the system calls that thread already makes: no `execve`, no
//! `open`, no `ptrace`, no new network sockets, no executable memory. The jail
//! (tenantvm-jail: namespaces, its own uid, no capabilities) is the outer wall; this is
//! the inner one.
//!
//! The lists come from tracing every thread kind through the KVM test suite
//! (`strace -f -ff`, docs/vmm.md). A call outside the list raises SIGSYS; the handler
//! installed by [`install_sigsys_handler`] names the call on stderr and ends the
//! process with [`EXIT_SECCOMP`], so a missing entry shows up as a clear failure.

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_ioeventfd, kvm_irq_routing, kvm_irqfd, kvm_msi, kvm_userspace_memory_region,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use tenantvm_devices::pci::vfio::{
    VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, VFIO_DEVICE_PCI_HOT_RESET, VFIO_DEVICE_RESET,
    VFIO_DEVICE_SET_IRQS,
};

/// Process exit status after a system call outside a thread's filter (docs/vmm.md).
pub const EXIT_SECCOMP: i32 = tenantvm_vmm_api::ExitStatus::SeccompViolation.code() as i32;

/// Whether and how filters are installed (part of the config file: tenantvm-vmm-api).
pub use tenantvm_vmm_api::SeccompMode;

/// The kinds of thread tenantvm-vmm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// The main thread once the VM runs: control socket, vCPU kicks, tear-down.
    Main,
    /// A vCPU: KVM_RUN and the port/MMIO handlers, including virtio activation.
    Vcpu,
    /// The device event loop: queue work, disk I/O, vsock sockets.
    Device,
    /// The thread that copies stdin into the UART.
    SerialInput,
    /// The thread that writes out batched guest console output.
    SerialOutput,
}

/// Why filters could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// A rule could not be expressed (a bug in this module).
    #[error("Cannot build the seccomp filter for the {kind:?} thread: {source}")]
    Build {
        /// The thread kind.
        kind: ThreadKind,
        /// What seccompiler said.
        source: seccompiler::BackendError,
    },
    /// The kernel refused the filter.
    #[error("Cannot install the seccomp filter for the {kind:?} thread: {source}; run with --seccomp off only to debug")]
    Install {
        /// The thread kind.
        kind: ThreadKind,
        /// What the kernel said.
        source: seccompiler::Error,
    },
    /// The SIGSYS handler could not be installed.
    #[error("Cannot install the SIGSYS handler: {0}")]
    Handler(#[source] std::io::Error),
}

/// The compiled filters, one per thread kind.
#[derive(Clone, Debug)]
pub struct Filters {
    main: BpfProgram,
    vcpu: BpfProgram,
    device: BpfProgram,
    serial_input: BpfProgram,
    serial_output: BpfProgram,
}

/// What a VM's configuration adds to the base filters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterExtras {
    /// Passed-through devices: vCPUs read and write device regions (pread64/pwrite64),
    /// set their interrupts (VFIO_DEVICE_SET_IRQS) and move BAR memory slots
    /// (KVM_SET_USER_MEMORY_REGION); the main thread turns interrupts off and resets the
    /// devices at detach (VFIO_DEVICE_SET_IRQS, VFIO_DEVICE_RESET and the hot reset pair).
    /// The same holds for devices opened through iommufd and their cdev: opening
    /// `/dev/iommu` and `/dev/vfio/devices/vfioN`, the IOAS map and the bind and attach all
    /// happen during set-up, before any filter, so no thread is given an iommufd ioctl.
    pub vfio: bool,
    /// An exit report: the main thread renames it into place as the VMM ends.
    pub exit_report: bool,
}

impl Filters {
    /// Compiles the filters for `mode`; `None` when it is [`SeccompMode::Off`].
    pub fn build(mode: SeccompMode) -> Result<Option<Self>, SeccompError> {
        Self::build_for(mode, FilterExtras::default())
    }

    /// Compiles the filters for `mode` with the calls `extras` need.
    pub fn build_for(
        mode: SeccompMode,
        extras: FilterExtras,
    ) -> Result<Option<Self>, SeccompError> {
        let mismatch = match mode {
            SeccompMode::Off => return Ok(None),
            SeccompMode::On => SeccompAction::Trap,
            SeccompMode::Log => SeccompAction::Log,
        };
        let compile = |kind: ThreadKind| -> Result<BpfProgram, SeccompError> {
            let rules =
                rules_for(kind, extras).map_err(|source| SeccompError::Build { kind, source })?;
            SeccompFilter::new(rules, mismatch.clone(), SeccompAction::Allow, target_arch())
                .and_then(BpfProgram::try_from)
                .map_err(|source| SeccompError::Build { kind, source })
        };
        Ok(Some(Self {
            main: compile(ThreadKind::Main)?,
            vcpu: compile(ThreadKind::Vcpu)?,
            device: compile(ThreadKind::Device)?,
            serial_input: compile(ThreadKind::SerialInput)?,
            serial_output: compile(ThreadKind::SerialOutput)?,
        }))
    }

    /// Installs `kind`'s filter on the calling thread (for good: filters cannot be
    /// removed, and threads it creates inherit it).
    pub fn apply(&self, kind: ThreadKind) -> Result<(), SeccompError> {
        let program = match kind {
            ThreadKind::Main => &self.main,
            ThreadKind::Vcpu => &self.vcpu,
            ThreadKind::Device => &self.device,
            ThreadKind::SerialInput => &self.serial_input,
            ThreadKind::SerialOutput => &self.serial_output,
        };
        seccompiler::apply_filter(program).map_err(|source| SeccompError::Install { kind, source })
    }
}

fn target_arch() -> TargetArch {
    TargetArch::x86_64
}

/// `_IOW(KVMIO, nr, size)`.
const fn kvm_iow(nr: u64, size: usize) -> u64 {
    const IOC_WRITE: u64 = 1;
    const KVMIO: u64 = 0xae;
    (IOC_WRITE << 30) | ((size as u64) << 16) | (KVMIO << 8) | nr
}

/// KVM_RUN: `_IO(KVMIO, 0x80)`.
const KVM_RUN: u64 = 0xae80;
/// KVM_IRQFD.
const KVM_IRQFD: u64 = kvm_iow(0x76, std::mem::size_of::<kvm_irqfd>());
/// KVM_IOEVENTFD.
const KVM_IOEVENTFD: u64 = kvm_iow(0x79, std::mem::size_of::<kvm_ioeventfd>());
/// KVM_SET_GSI_ROUTING.
const KVM_SET_GSI_ROUTING: u64 = kvm_iow(0x6a, std::mem::size_of::<kvm_irq_routing>());
/// KVM_SIGNAL_MSI.
const KVM_SIGNAL_MSI: u64 = kvm_iow(0xa5, std::mem::size_of::<kvm_msi>());
/// KVM_SET_USER_MEMORY_REGION.
const KVM_SET_USER_MEMORY_REGION: u64 =
    kvm_iow(0x46, std::mem::size_of::<kvm_userspace_memory_region>());

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// A rule matching when argument `arg` equals `value`.
fn arg_is(arg: u8, value: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        value,
    )?])
}

/// A rule matching when argument `arg` has none of the bits in `mask`.
fn arg_lacks(arg: u8, mask: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(mask),
        0,
    )?])
}

fn allow(rules: &mut Rules, syscalls: &[i64]) {
    for &nr in syscalls {
        rules.insert(nr, Vec::new());
    }
}

/// ioctl allowed only with these request numbers.
fn allow_ioctls(rules: &mut Rules, requests: &[u64]) -> Result<(), seccompiler::BackendError> {
    let list = requests
        .iter()
        .map(|&r| arg_is(1, r))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, list);
    Ok(())
}

/// What every Rust thread needs: memory (never executable), locks, signals, clocks,
/// reading and writing descriptors it holds, closing them, leaving.
fn common() -> Result<Rules, seccompiler::BackendError> {
    let mut rules = Rules::new();
    allow(
        &mut rules,
        &[
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_writev,
            libc::SYS_close,
            libc::SYS_futex,
            libc::SYS_munmap,
            libc::SYS_madvise,
            libc::SYS_mremap,
            libc::SYS_brk,
            libc::SYS_rt_sigprocmask,
            libc::SYS_rt_sigreturn,
            libc::SYS_sigaltstack,
            libc::SYS_sched_yield,
            libc::SYS_sched_getaffinity,
            libc::SYS_gettid,
            libc::SYS_getpid,
            libc::SYS_getrandom,
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            libc::SYS_restart_syscall,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_fcntl,
        ],
    );
    // Memory, but never executable: no new code can be mapped in.
    let prot_exec = libc::PROT_EXEC as u64;
    rules.insert(libc::SYS_mmap, vec![arg_lacks(2, prot_exec)?]);
    rules.insert(libc::SYS_mprotect, vec![arg_lacks(2, prot_exec)?]);
    Ok(rules)
}

/// An epoll loop (the main thread's control socket, the device thread's event manager).
const EPOLL_LOOP: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
];

/// Serving accepted Unix stream connections (control socket, vsock host side).
const STREAM_SERVER: &[i64] = &[
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_shutdown,
];

/// The allowlist of one thread kind.
fn rules_for(kind: ThreadKind, extras: FilterExtras) -> Result<Rules, seccompiler::BackendError> {
    let mut rules = common()?;
    match kind {
        ThreadKind::Main => {
            allow(&mut rules, EPOLL_LOOP);
            allow(&mut rules, STREAM_SERVER);
            allow(&mut rules, &[libc::SYS_unlink, libc::SYS_tgkill]);
            if extras.exit_report {
                allow(&mut rules, &[libc::SYS_rename]);
            }
            let mut ioctls = vec![
                libc::FIONBIO,
                libc::TCGETS,
                libc::TCSETS,
                libc::TCSETSW,
                libc::TCSETSF,
            ];
            if extras.vfio {
                ioctls.extend([
                    VFIO_DEVICE_SET_IRQS,
                    VFIO_DEVICE_RESET,
                    VFIO_DEVICE_GET_PCI_HOT_RESET_INFO,
                    VFIO_DEVICE_PCI_HOT_RESET,
                ]);
            }
            allow_ioctls(&mut rules, &ioctls)?;
        }
        ThreadKind::Vcpu => {
            // Virtio activation and MSI-X programming run here, on the guest's MMIO
            // writes: eventfds, timerfds and dups for the device handlers.
            allow(&mut rules, &[libc::SYS_eventfd2, libc::SYS_timerfd_create]);
            let mut ioctls = vec![
                KVM_RUN,
                KVM_IRQFD,
                KVM_IOEVENTFD,
                KVM_SET_GSI_ROUTING,
                KVM_SIGNAL_MSI,
            ];
            if extras.vfio {
                allow(&mut rules, &[libc::SYS_pread64, libc::SYS_pwrite64]);
                ioctls.extend([VFIO_DEVICE_SET_IRQS, KVM_SET_USER_MEMORY_REGION]);
            }
            allow_ioctls(&mut rules, &ioctls)?;
        }
        ThreadKind::Device => {
            allow(&mut rules, EPOLL_LOOP);
            allow(&mut rules, STREAM_SERVER);
            allow(
                &mut rules,
                &[
                    libc::SYS_eventfd2,
                    libc::SYS_timerfd_create,
                    libc::SYS_timerfd_settime,
                    libc::SYS_timerfd_gettime,
                    libc::SYS_preadv,
                    libc::SYS_pwritev,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_fdatasync,
                    libc::SYS_fsync,
                    libc::SYS_fallocate,
                    libc::SYS_connect,
                    libc::SYS_getsockopt,
                ],
            );
            // vsock reaches host services over Unix sockets only.
            rules.insert(libc::SYS_socket, vec![arg_is(0, libc::AF_UNIX as u64)?]);
            allow_ioctls(&mut rules, &[libc::FIONBIO])?;
        }
        ThreadKind::SerialInput => {
            allow(&mut rules, &[libc::SYS_poll, libc::SYS_ppoll]);
        }
        // Waits on a condvar and writes to stdout or the serial file: the common set.
        ThreadKind::SerialOutput => {}
    }
    Ok(rules)
}

/// Installs the process-wide SIGSYS handler that reports a call outside a filter and
/// exits with [`EXIT_SECCOMP`]. Call once, before any filter is applied.
pub fn install_sigsys_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is a valid starting point; the handler only calls
    // async-signal-safe functions (write, _exit).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = sigsys_handler as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(SeccompError::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Formats `n` in decimal into `buf`; returns the digits.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

extern "C" fn sigsys_handler(
    _sig: libc::c_int,
    info: *mut libc::siginfo_t,
    _ctx: *mut libc::c_void,
) {
    // siginfo_t for SIGSYS (asm-generic/siginfo.h): after si_signo, si_errno, si_code
    // and padding to 16 bytes come `void *_call_addr; int _syscall; unsigned _arch`.
    const SYSCALL_OFFSET: usize = 16 + std::mem::size_of::<usize>();
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO handler; SIGSYS from
    // seccomp fills the fields read here.
    let nr = unsafe {
        (info as *const u8)
            .add(SYSCALL_OFFSET)
            .cast::<i32>()
            .read_unaligned()
    };
    let mut digits = [0u8; 20];
    let parts: [&[u8]; 3] = [
        b"tenantvm-vmm: a thread made system call ",
        decimal(nr as u64, &mut digits),
        b", which its seccomp filter does not allow; stopping (exit status 20). Report it with the command that led here.\n",
    ];
    for part in parts {
        // SAFETY: write(2) on stderr with a valid buffer; async-signal-safe.
        unsafe { libc::write(libc::STDERR_FILENO, part.as_ptr().cast(), part.len()) };
    }
    // SAFETY: _exit is async-signal-safe and ends the process at once.
    unsafe { libc::_exit(EXIT_SECCOMP) };
}

#[cfg(test)]
mod tests;
