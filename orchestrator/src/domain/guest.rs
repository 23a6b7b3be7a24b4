//! What runs in a tenant's guest: decided once, when the tenant is created, from its image,
//! and stored with the tenant, so no later step has to look at the image directory again.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Whether a tenant's guest runs the tenantvm agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestKind {
    /// A guest image set (`guest-image/build.sh`): the agent is PID 1, and the daemon
    /// unlocks the disk, starts the payload and forwards inference through it.
    Agent,
    /// A kernel (and initramfs) without the agent: the daemon only runs the VM.
    Plain,
}

impl GuestKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            GuestKind::Agent => "agent",
            GuestKind::Plain => "plain",
        }
    }
}

impl fmt::Display for GuestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored guest kind this binary does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown guest kind {0:?}")]
pub struct UnknownGuestKind(pub String);

impl FromStr for GuestKind {
    type Err = UnknownGuestKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "agent" => Ok(GuestKind::Agent),
            "plain" => Ok(GuestKind::Plain),
            other => Err(UnknownGuestKind(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for g in [GuestKind::Agent, GuestKind::Plain] {
            assert_eq!(g.as_str().parse::<GuestKind>().unwrap(), g);
        }
        "qemu".parse::<GuestKind>().unwrap_err();
    }
}
