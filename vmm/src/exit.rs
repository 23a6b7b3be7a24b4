//! Why the VM ended, and the one place that records it.

use std::sync::Mutex;

use tenantvm_devices::legacy::{GuestRequest, GuestRequestSink};
use tenantvm_vmm_api::ExitStatus;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Why the VM stopped: the documented exit status the process ends with (one of the
/// statuses of a VM that ran, 0 to 7), and, where the status alone does not say, what the
/// VMM knows of why (KVM's exit, the failed call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReason {
    status: ExitStatus,
    detail: Option<String>,
}

impl ExitReason {
    /// The guest powered off through the ACPI sleep control register.
    pub const POWER_OFF: ExitReason = ExitReason::plain(ExitStatus::PowerOff);
    /// The guest asked for a reset.
    pub const RESET: ExitReason = ExitReason::plain(ExitStatus::Reset);
    /// A vCPU triple-faulted (KVM_EXIT_SHUTDOWN).
    pub const TRIPLE_FAULT: ExitReason = ExitReason::plain(ExitStatus::TripleFault);
    /// The guest reported a crash through pvpanic.
    pub const GUEST_PANIC: ExitReason = ExitReason::plain(ExitStatus::GuestPanic);
    /// The control socket asked for a shutdown.
    pub const API_SHUTDOWN: ExitReason = ExitReason::plain(ExitStatus::Stopped);

    const fn plain(status: ExitStatus) -> ExitReason {
        ExitReason {
            status,
            detail: None,
        }
    }

    /// KVM could not run the guest (internal error, failed entry, unhandled exit): `why`.
    pub fn guest_unrunnable(why: impl Into<String>) -> ExitReason {
        ExitReason {
            status: ExitStatus::GuestUnrunnable,
            detail: Some(why.into()),
        }
    }

    /// The VMM itself failed (a KVM ioctl, a device thread): `why`.
    pub fn vmm_error(why: impl Into<String>) -> ExitReason {
        ExitReason {
            status: ExitStatus::VmmError,
            detail: Some(why.into()),
        }
    }

    /// The process exit status documented in docs/vmm.md.
    pub fn exit_status(&self) -> ExitStatus {
        self.status
    }

    /// What the VMM knows of why, beyond the status.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
}

impl std::fmt::Display for ExitReason {
    /// The status's documented meaning, then the detail (`the guest could not be run
    /// (...): KVM_EXIT_FAIL_ENTRY ...`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.status.description())?;
        match &self.detail {
            Some(why) => write!(f, ": {why}"),
            None => Ok(()),
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
            GuestRequest::PowerOff => ExitReason::POWER_OFF,
            GuestRequest::Reset => ExitReason::RESET,
            GuestRequest::Panic => ExitReason::GUEST_PANIC,
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
        state.stop(ExitReason::POWER_OFF);
        assert_eq!(state.reason(), Some(ExitReason::GUEST_PANIC));
        assert!(state.event().read().unwrap() >= 1);
    }

    #[test]
    fn every_reason_has_a_distinct_documented_status() {
        let all = [
            ExitReason::POWER_OFF,
            ExitReason::vmm_error("a device thread died"),
            ExitReason::RESET,
            ExitReason::TRIPLE_FAULT,
            ExitReason::GUEST_PANIC,
            ExitReason::API_SHUTDOWN,
            ExitReason::guest_unrunnable("KVM_EXIT_INTERNAL_ERROR"),
        ];
        let statuses: Vec<u8> = all.iter().map(|r| r.exit_status().code()).collect();
        assert_eq!(statuses, vec![0, 1, 3, 4, 5, 6, 7]);
        for reason in &all {
            assert!(!reason.exit_status().is_start_failure(), "{reason}");
        }
    }

    #[test]
    fn a_reason_says_its_status_and_its_detail() {
        assert_eq!(
            ExitReason::guest_unrunnable("KVM_EXIT_FAIL_ENTRY 0x80000021 on cpu 0").to_string(),
            format!(
                "{}: KVM_EXIT_FAIL_ENTRY 0x80000021 on cpu 0",
                ExitStatus::GuestUnrunnable.description()
            )
        );
        assert_eq!(
            ExitReason::POWER_OFF.to_string(),
            ExitStatus::PowerOff.description()
        );
        assert_eq!(ExitReason::RESET.detail(), None);
    }
}
