//! The tenant lifecycle state machine.
//!
//! ```text
//! pending -> provisioning -> running -> stopping -> stopped -> provisioning (start)
//!    |            |             |          |           |
//!    +------------+-------------+----------+-----------+--> destroying -> destroyed
//!   any of provisioning, running, stopping, destroying -> failed -> destroying
//! ```
//! Every state change goes through [`LifecycleState::check_transition`], which the store
//! calls inside the transaction that records it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A refused state change.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LifecycleError {
    /// The transition is not in the table.
    #[error("Tenant is {from}; it cannot go to {to} (allowed from {from}: {allowed})")]
    InvalidTransition {
        /// Current state.
        from: LifecycleState,
        /// Requested state.
        to: LifecycleState,
        /// The states reachable from `from`, for the message.
        allowed: String,
    },
    /// A stored state string is unknown.
    #[error("Unknown lifecycle state {0:?} in the store")]
    UnknownState(String),
}

/// Where a tenant is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LifecycleState {
    /// Recorded, nothing done yet.
    Pending,
    /// Create (or start) steps running.
    Provisioning,
    /// The VM runs.
    Running,
    /// Stop steps running.
    Stopping,
    /// The VM is stopped; resources other than the process are kept.
    Stopped,
    /// Destroy steps running.
    Destroying,
    /// Everything released; the row stays as a record.
    Destroyed,
    /// A step failed; destroy releases what is left.
    Failed,
}

use LifecycleState::*;

impl LifecycleState {
    /// Every state, in lifecycle order.
    pub const ALL: [LifecycleState; 8] = [
        Pending,
        Provisioning,
        Running,
        Stopping,
        Stopped,
        Destroying,
        Destroyed,
        Failed,
    ];

    /// The states this one may move to.
    pub fn successors(self) -> &'static [LifecycleState] {
        match self {
            Pending => &[Provisioning, Destroying, Failed],
            Provisioning => &[Running, Failed, Destroying],
            Running => &[Stopping, Destroying, Failed],
            Stopping => &[Stopped, Failed, Destroying],
            Stopped => &[Provisioning, Destroying],
            Destroying => &[Destroyed, Failed],
            Destroyed => &[],
            Failed => &[Destroying],
        }
    }

    /// Ok if `self -> to` is allowed.
    pub fn check_transition(self, to: LifecycleState) -> Result<(), LifecycleError> {
        if self.successors().contains(&to) {
            return Ok(());
        }
        let allowed = self
            .successors()
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        Err(LifecycleError::InvalidTransition {
            from: self,
            to,
            allowed: if allowed.is_empty() {
                "nothing".into()
            } else {
                allowed
            },
        })
    }

    /// Lower-case name, as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Pending => "pending",
            Provisioning => "provisioning",
            Running => "running",
            Stopping => "stopping",
            Stopped => "stopped",
            Destroying => "destroying",
            Destroyed => "destroyed",
            Failed => "failed",
        }
    }

    /// Whether work is half done in this state (reconcile resumes it).
    pub fn is_transient(self) -> bool {
        matches!(self, Pending | Provisioning | Stopping | Destroying)
    }
}

impl fmt::Display for LifecycleState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LifecycleState {
    type Err = LifecycleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LifecycleState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| LifecycleError::UnknownState(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn happy_path_is_allowed() {
        let path = [
            Pending,
            Provisioning,
            Running,
            Stopping,
            Stopped,
            Provisioning,
            Running,
            Destroying,
            Destroyed,
        ];
        for pair in path.windows(2) {
            pair[0].check_transition(pair[1]).unwrap();
        }
    }

    #[test]
    fn destroyed_is_terminal() {
        for to in LifecycleState::ALL {
            assert!(Destroyed.check_transition(to).is_err());
        }
    }

    #[test]
    fn skipping_states_is_refused() {
        let err = Pending.check_transition(Running).unwrap_err();
        assert!(err.to_string().contains("cannot go to running"), "{err}");
        assert!(Running.check_transition(Stopped).is_err());
        assert!(Stopped.check_transition(Running).is_err());
        assert!(Failed.check_transition(Running).is_err());
    }

    #[test]
    fn names_round_trip() {
        for st in LifecycleState::ALL {
            assert_eq!(st.as_str().parse::<LifecycleState>().unwrap(), st);
        }
        "zombie".parse::<LifecycleState>().unwrap_err();
    }

    #[test]
    fn only_work_in_progress_is_transient() {
        assert!(Provisioning.is_transient());
        assert!(!Running.is_transient());
        assert!(!Destroyed.is_transient());
    }
}
