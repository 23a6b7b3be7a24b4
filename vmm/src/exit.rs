//! Why the VM ended, and the one place that records it.

use std::sync::Mutex;

use tenantvm_devices::legacy::{GuestRequest, GuestRequestSink};
use tenantvm_vmm_api::ExitStatus;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Why the VM stopped; each maps to a documented process exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest powered off through the ACPI sleep control register.
    PowerOff,
    /// The guest asked for a reset.
    Reset,
    /// A vCPU triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// The guest reported a crash through pvpanic.
    GuestPanic,
    /// The control socket asked for a shutdown.
    ApiShutdown,
    /// KVM could not run the guest (internal error, failed entry, unhandled exit).
    GuestUnrunnable(String),
    /// The VMM itself failed (a KVM ioctl, a device thread).
    VmmError(String),
}

impl ExitReason {
    /// The process exit status documented in docs/vmm.md.
    pub fn exit_status(&self) -> ExitStatus {
        match self {
            ExitReason::PowerOff => ExitStatus::PowerOff,
            ExitReason::VmmError(_) => ExitStatus::VmmError,
            ExitReason::Reset => ExitStatus::Reset,
            ExitReason::TripleFault => ExitStatus::TripleFault,
            ExitReason::GuestPanic => ExitStatus::GuestPanic,
            ExitReason::ApiShutdown => ExitStatus::Stopped,
            ExitReason::GuestUnrunnable(_) => ExitStatus::GuestUnrunnable,
        }
    }
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitReason::PowerOff => write!(f, "The guest powered off"),
            ExitReason::Reset => write!(f, "The guest asked for a reset"),
            ExitReason::TripleFault => write!(f, "A vCPU triple-faulted (KVM_EXIT_SHUTDOWN)"),
            ExitReason::GuestPanic => write!(f, "The guest reported a crash (pvpanic)"),
            ExitReason::ApiShutdown => write!(f, "Stopped through the control socket"),
            ExitReason::GuestUnrunnable(why) => write!(f, "The guest could not be run: {why}"),
            ExitReason::VmmError(why) => write!(f, "VMM runtime error: {why}"),
        }
    }
}

/// Records the first exit reason and wakes the VMM's event loop.
pub struct ExitState {
    reason: Mutex<Option<ExitReason>>,
    event: EventFd,
}

impl ExitState {
    /// Creates an empty state with its wake-up eventfd.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            reason: Mutex::new(None),
            event: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Records `reason` unless one is already recorded, and wakes the event loop.
    pub fn stop(&self, reason: ExitReason) {
        let mut slot = self
            .reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(reason);
        }
        drop(slot);
        // A full counter (impossible with one write per stop) would still leave it readable.
        let _ = self.event.write(1);
    }

    /// The recorded reason, if any.
    pub fn reason(&self) -> Option<ExitReason> {
        self.reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The eventfd that becomes readable once a reason is recorded.
    pub fn event(&self) -> &EventFd {
        &self.event
    }
}

impl GuestRequestSink for ExitState {
    fn request(&self, request: GuestRequest) {
        self.stop(match request {
            GuestRequest::PowerOff => ExitReason::PowerOff,
            GuestRequest::Reset => ExitReason::Reset,
            GuestRequest::Panic => ExitReason::GuestPanic,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins_and_wakes_the_loop() {
        let state = ExitState::new().unwrap();
        state.request(GuestRequest::Panic);
        state.stop(ExitReason::PowerOff);
        assert_eq!(state.reason(), Some(ExitReason::GuestPanic));
        assert!(state.event().read().unwrap() >= 1);
    }

    #[test]
    fn every_reason_has_a_distinct_documented_status() {
        let all = [
            ExitReason::PowerOff,
            ExitReason::VmmError(String::new()),
            ExitReason::Reset,
            ExitReason::TripleFault,
            ExitReason::GuestPanic,
            ExitReason::ApiShutdown,
            ExitReason::GuestUnrunnable(String::new()),
        ];
        let statuses: Vec<u8> = all.iter().map(|r| r.exit_status().code()).collect();
        assert_eq!(statuses, vec![0, 1, 3, 4, 5, 6, 7]);
    }
}
