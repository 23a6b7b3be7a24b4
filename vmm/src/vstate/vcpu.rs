//! vCPUs: configuration, and the run loop each runs on its own thread.
//!
//! Only vCPU 0 (the BSP) starts running; the others wait in KVM's wait-for-SIPI state until
//! the guest starts them with INIT-SIPI-SIPI through its local APIC, as on real hardware.
//! The VMM's main thread pauses, resumes and stops vCPUs through [`VcpuControl`], kicking
//! them out of KVM_RUN with a signal.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_mp_state, kvm_run, KVM_MP_STATE_RUNNABLE, KVM_MP_STATE_UNINITIALIZED};
use kvm_bindings::{KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use tenantvm_devices::bus::{Bus, SharedBusDevice};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::{cpuid, kvm_err, regs, VstateError};
use crate::boot::EntryPoint;
use crate::exit::{ExitReason, ExitState};
use crate::seccomp::{Filters, ThreadKind};

/// The port and memory buses a vCPU dispatches its exits to.
#[derive(Debug, Default)]
pub struct Buses {
    /// Port I/O.
    pub pio: Bus,
    /// MMIO. Behind a lock because a guest BAR move changes it at run time; dispatch
    /// takes the device out of the bus and releases the lock before calling it (the
    /// device may move a BAR, which takes the lock for writing).
    pub mmio: Arc<RwLock<Bus>>,
}

impl Buses {
    /// The device under the MMIO access `[addr, addr + len)` and its range base, cloned
    /// out of the bus so that no bus lock is held while the device runs.
    fn mmio_target(&self, addr: u64, len: usize) -> Option<(u64, SharedBusDevice)> {
        let bus = self.mmio.read().unwrap_or_else(PoisonError::into_inner);
        bus.resolve(addr, len)
            .map(|(base, dev)| (base, dev.clone()))
    }

    /// Dispatches an MMIO read; unmapped addresses read all-ones.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.mmio_target(addr, data.len()) {
            Some((base, dev)) => {
                dev.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .read(base, addr - base, data);
            }
            None => data.fill(0xff),
        }
    }

    /// Dispatches an MMIO write; writes to unmapped addresses are dropped.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        if let Some((base, dev)) = self.mmio_target(addr, data.len()) {
            dev.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .write(base, addr - base, data);
        }
    }
}

/// Sets up vCPU `id` of `count`: CPUID, MSRs, FPU, LAPIC, and for the BSP the registers
/// to enter `entry`; APs are left waiting for SIPI.
pub fn configure(
    fd: &VcpuFd,
    id: u32,
    count: u32,
    supported: &kvm_bindings::CpuId,
    mem: &GuestMemoryMmap,
    entry: EntryPoint,
) -> Result<(), VstateError> {
    fd.set_cpuid2(&cpuid::filter(supported, id, count))
        .map_err(kvm_err("set CPUID"))?;
    let msrs = regs::boot_msrs()
        .map_err(|e| VstateError::Memory(format!("Cannot build the boot MSR list: {e:?}")))?;
    let written = fd.set_msrs(&msrs).map_err(kvm_err("set MSRs"))?;
    if written != msrs.as_slice().len() {
        return Err(VstateError::Kvm {
            what: "set all boot MSRs",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    fd.set_fpu(&regs::boot_fpu())
        .map_err(kvm_err("set the FPU"))?;
    let mut lapic = fd.get_lapic().map_err(kvm_err("read the LAPIC"))?;
    regs::set_lint(&mut lapic);
    fd.set_lapic(&lapic).map_err(kvm_err("set the LAPIC"))?;
    if id == 0 {
        let sregs = fd.get_sregs().map_err(kvm_err("read special registers"))?;
        let sregs = regs::setup_sregs(mem, entry, sregs).map_err(|e| {
            VstateError::Memory(format!("Cannot write the GDT or page tables: {e}"))
        })?;
        fd.set_sregs(&sregs)
            .map_err(kvm_err("set special registers"))?;
        fd.set_regs(&regs::boot_regs(entry))
            .map_err(kvm_err("set registers"))?;
        fd.set_mp_state(kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        })
        .map_err(kvm_err("make the BSP runnable"))?;
    } else {
        fd.set_mp_state(kvm_mp_state {
            mp_state: KVM_MP_STATE_UNINITIALIZED,
        })
        .map_err(kvm_err("put an AP in wait-for-SIPI"))?;
    }
    Ok(())
}

#[derive(Debug, Default)]
struct ControlState {
    paused: bool,
    stop: bool,
    parked: usize,
}

/// Pause/resume/stop requests from the main thread to every vCPU thread.
#[derive(Debug, Default)]
pub struct VcpuControl {
    state: Mutex<ControlState>,
    changed: Condvar,
}

impl VcpuControl {
    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the vCPU should stop for good.
    fn should_stop(&self) -> bool {
        self.lock().stop
    }

    /// Parks the calling vCPU while paused; returns false when it should stop instead.
    fn park_while_paused(&self) -> bool {
        let mut state = self.lock();
        if !state.paused {
            return !state.stop;
        }
        state.parked += 1;
        self.changed.notify_all();
        while state.paused && !state.stop {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.parked -= 1;
        !state.stop
    }
}

/// Signal used to kick vCPU threads out of KVM_RUN.
fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) handler for the kick signal, so that it interrupts KVM_RUN with
/// EINTR instead of killing the process. Call once before starting vCPUs.
pub fn install_kick_handler() -> Result<(), VstateError> {
    register_signal_handler(kick_signal(), handle_kick).map_err(|e| VstateError::Kvm {
        what: "install the vCPU kick signal handler",
        source: kvm_ioctls::Error::new(e.errno()),
    })
}

/// Not every vCPU stopped within [`PAUSE_TIMEOUT`]; the VM was left running.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "Only {parked} of {running} vCPUs stopped within 5 s, so the VM was left running; a vCPU \
     is probably blocked on serial output nobody reads"
)]
pub struct VcpuPauseError {
    /// vCPUs that had parked.
    pub parked: usize,
    /// vCPUs still alive.
    pub running: usize,
}

/// The running vCPU threads.
pub struct VcpuSet {
    threads: Vec<JoinHandle<()>>,
    control: Arc<VcpuControl>,
}

/// How often the main thread re-kicks vCPUs that have not yet reacted (a kick sent just
/// before a vCPU enters KVM_RUN is lost, so kicks repeat).
const KICK_INTERVAL: Duration = Duration::from_millis(5);
/// How long `pause` waits for every vCPU to park.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `stop` waits for vCPU threads before giving up on joining them.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

impl VcpuSet {
    /// Starts one thread per vCPU.
    /// With `filters`, each thread installs the vCPU seccomp filter on itself before it
    /// first enters the guest (and ends the VM if it cannot).
    pub fn start(
        vcpus: Vec<VcpuFd>,
        buses: Arc<Buses>,
        exit: Arc<ExitState>,
        filters: Option<Arc<Filters>>,
    ) -> Result<Self, VstateError> {
        let control = Arc::new(VcpuControl::default());
        let mut threads = Vec::with_capacity(vcpus.len());
        for (id, fd) in vcpus.into_iter().enumerate() {
            let (buses, exit, control) = (buses.clone(), exit.clone(), control.clone());
            let filters = filters.clone();
            let thread = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    if let Some(Err(e)) = filters.map(|f| f.apply(ThreadKind::Vcpu)) {
                        exit.stop(ExitReason::vmm_error(e.to_string()));
                        return;
                    }
                    run_vcpu(fd, &buses, &control, &exit);
                })
                .map_err(|e| VstateError::Kvm {
                    what: "start a vCPU thread",
                    source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EAGAIN)),
                })?;
            threads.push(thread);
        }
        Ok(Self { threads, control })
    }

    /// Number of vCPUs.
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// Whether there are no vCPUs.
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    fn kick_all(&self) {
        for t in &self.threads {
            if !t.is_finished() {
                // A thread that exits between the check and the kill is harmless.
                let _ = t.kill(kick_signal());
            }
        }
    }

    /// Stops every vCPU at its next exit and waits until all are parked.
    ///
    /// A vCPU stuck in a device handler (say, writing serial output to a pipe nobody
    /// reads) cannot park; after [`PAUSE_TIMEOUT`] the pause is undone and refused, so the
    /// VM never ends up half paused.
    pub fn pause(&self) -> Result<(), VcpuPauseError> {
        self.control.lock().paused = true;
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        loop {
            self.kick_all();
            let state = self.control.lock();
            let running = self.threads.iter().filter(|t| !t.is_finished()).count();
            if state.parked >= running || state.stop {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let parked = state.parked;
                drop(state);
                self.resume();
                return Err(VcpuPauseError { parked, running });
            }
            let _ = self.control.changed.wait_timeout(state, KICK_INTERVAL);
        }
    }

    /// Lets paused vCPUs run again.
    pub fn resume(&self) {
        self.control.lock().paused = false;
        self.control.changed.notify_all();
    }

    /// Stops every vCPU thread and joins them.
    pub fn stop(self) {
        self.control.lock().stop = true;
        self.control.changed.notify_all();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            self.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        for t in self.threads {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// Runs one vCPU until the VM ends, turning a panic in exit handling into a VMM error so
/// that the VM stops instead of hanging with one vCPU gone.
fn run_vcpu(fd: VcpuFd, buses: &Buses, control: &VcpuControl, exit: &ExitState) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        vcpu_loop(fd, buses, control, exit);
    }));
    if outcome.is_err() {
        exit.stop(ExitReason::vmm_error("a vCPU thread panicked"));
    }
}

/// Width in bytes of each access of the port I/O exit in progress (1, 2 or 4; string I/O
/// such as `rep outsb` hands over `count` accesses of this width at once).
///
/// # Safety
/// `run` must point at the vCPU's mapped `kvm_run` and the last exit must be KVM_EXIT_IO.
unsafe fn io_access_width(run: *const kvm_run) -> usize {
    // SAFETY: the caller guarantees `run` is the live kvm_run mapping and that the `io`
    // member of the exit union is the active one. The data slice KVM_RUN handed out lies
    // at `io.data_offset`, past the header read here, so the two do not overlap.
    let size = unsafe { (*run).__bindgen_anon_1.io.size };
    usize::from(size).max(1)
}

/// The suberror of a KVM_EXIT_INTERNAL_ERROR.
///
/// # Safety
/// `run` must point at the vCPU's mapped `kvm_run` and the last exit must be
/// KVM_EXIT_INTERNAL_ERROR.
unsafe fn internal_error_suberror(run: *const kvm_run) -> u32 {
    // SAFETY: the caller guarantees the mapping is live and `internal` is the active member.
    unsafe { (*run).__bindgen_anon_1.internal.suberror }
}

fn describe_internal_error(suberror: u32) -> &'static str {
    match suberror {
        // Seen on nested AMD hosts without NRIPS, where KVM emulates software interrupts
        // (int3, int n): an `int` through an empty IDT ends here, not in a triple fault.
        1 => "KVM could not emulate an instruction",
        2 => "an exception occurred while KVM emulated an instruction",
        3 => "an exception occurred while delivering an event",
        4 => "unexpected exit reason from hardware",
        _ => "unknown suberror",
    }
}

fn vcpu_loop(mut fd: VcpuFd, buses: &Buses, control: &VcpuControl, exit: &ExitState) {
    // The kvm_run mapping lives as long as `fd`; it is read only for the I/O access width.
    let run: *const kvm_run = fd.get_kvm_run();
    loop {
        if !control.park_while_paused() || control.should_stop() {
            return;
        }
        let outcome = match fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                // SAFETY: `run` is this vCPU's kvm_run and the exit is KVM_EXIT_IO.
                let width = unsafe { io_access_width(run) };
                for access in data.chunks_mut(width) {
                    buses.pio.read(u64::from(port), access);
                }
                None
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                // SAFETY: `run` is this vCPU's kvm_run and the exit is KVM_EXIT_IO.
                let width = unsafe { io_access_width(run) };
                for access in data.chunks(width) {
                    buses.pio.write(u64::from(port), access);
                }
                None
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                buses.mmio_read(addr, data);
                None
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                buses.mmio_write(addr, data);
                None
            }
            Ok(VcpuExit::Hlt | VcpuExit::Intr | VcpuExit::IrqWindowOpen) => None,
            Ok(VcpuExit::Shutdown) => Some(ExitReason::TRIPLE_FAULT),
            Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                KVM_SYSTEM_EVENT_SHUTDOWN => Some(ExitReason::POWER_OFF),
                KVM_SYSTEM_EVENT_RESET => Some(ExitReason::RESET),
                KVM_SYSTEM_EVENT_CRASH => Some(ExitReason::GUEST_PANIC),
                other => Some(ExitReason::guest_unrunnable(format!(
                    "unhandled KVM system event {other}"
                ))),
            },
            Ok(VcpuExit::FailEntry(reason, cpu)) => Some(ExitReason::guest_unrunnable(format!(
                "VM entry failed (hardware reason {reason:#x}, cpu {cpu})"
            ))),
            Ok(VcpuExit::InternalError) => {
                // SAFETY: `run` is this vCPU's kvm_run and the exit is KVM_EXIT_INTERNAL_ERROR.
                let suberror = unsafe { internal_error_suberror(run) };
                Some(ExitReason::guest_unrunnable(format!(
                    "KVM internal error {suberror} ({})",
                    describe_internal_error(suberror)
                )))
            }
            Ok(other) => Some(ExitReason::guest_unrunnable(format!(
                "unhandled vCPU exit {other:?}"
            ))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => Some(ExitReason::vmm_error(format!("KVM_RUN failed: {e}"))),
        };
        if let Some(reason) = outcome {
            exit.stop(reason);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_parked(control: &VcpuControl, n: usize) {
        let mut state = control.lock();
        while state.parked < n {
            state = control.changed.wait(state).unwrap();
        }
    }

    #[test]
    fn paused_vcpu_parks_until_resumed() {
        let control = Arc::new(VcpuControl::default());
        control.lock().paused = true;
        let c = control.clone();
        let vcpu = std::thread::spawn(move || c.park_while_paused());
        wait_parked(&control, 1);
        control.lock().paused = false;
        control.changed.notify_all();
        assert!(vcpu.join().unwrap(), "a resumed vCPU keeps running");
        assert_eq!(control.lock().parked, 0);
    }

    #[test]
    fn stop_releases_a_parked_vcpu_for_good() {
        let control = Arc::new(VcpuControl::default());
        control.lock().paused = true;
        let c = control.clone();
        let vcpu = std::thread::spawn(move || c.park_while_paused());
        wait_parked(&control, 1);
        control.lock().stop = true;
        control.changed.notify_all();
        assert!(!vcpu.join().unwrap(), "a stopped vCPU does not run again");
    }

    #[test]
    fn running_vcpu_does_not_park() {
        let control = VcpuControl::default();
        assert!(control.park_while_paused());
        control.lock().stop = true;
        assert!(!control.park_while_paused());
    }
}
