//! Test helpers for tenantvm: build and locate the no_std test guests (`tests/guests`), run
//! `tenantvm-vmm` on them under real KVM with a timeout, capture the serial console and the
//! exit status, read the guests' `TVMTEST` report lines, and talk to the control socket.
//!
//! Tests that need `/dev/kvm` start with [`require_kvm!`], which records the skip
//! (tenantvm-skip: `SKIP <test>: <reason>`, counted by scripts/test.sh) and returns when KVM
//! is not usable here.

mod api;
mod guests;
mod report;
mod run;
mod socket;

pub use api::{api_request, ApiError};
pub use guests::{guest, guests_dir, kvm_unavailable, GuestError, GuestImage};
pub use report::{parse_report, Report, ReportError, Verdict};
pub use run::{RunError, RunOutcome, RunningVm, VmRun};
pub use socket::stale_unix_socket;

/// Exit statuses of tenantvm-vmm (docs/vmm.md).
pub mod exit {
    /// The guest powered off (sleep control register, S5).
    pub const POWER_OFF: i32 = 0;
    /// The guest asked for a reset.
    pub const RESET: i32 = 3;
    /// A vCPU triple-faulted.
    pub const TRIPLE_FAULT: i32 = 4;
    /// The guest reported a crash through pvpanic.
    pub const GUEST_PANIC: i32 = 5;
    /// Stopped through the control socket.
    pub const SHUTDOWN: i32 = 6;
}

#[doc(hidden)]
pub use tenantvm_skip as __skip;

/// Returns from the calling test `$test`, recording the skip (tenantvm-skip), when
/// `/dev/kvm` is not usable.
#[macro_export]
macro_rules! require_kvm {
    ($test:expr) => {
        if let Some(reason) = $crate::kvm_unavailable() {
            $crate::__skip::record(&format!("{}::{}", env!("CARGO_CRATE_NAME"), $test), reason);
            return;
        }
    };
}
