//! How checks 5 and 6 send a probe's requests: through the front door with inference keys
//! of the probe's own, as its clients do, when the operator named one (`--front-door`);
//! otherwise with its tenant token on the daemon's API infer route. The report says which.

use super::host::{Caller, HostError, VerifyHost};

/// Which door a probe's requests go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// The front door (TLS, an inference key; the front door picks the tenant from it).
    FrontDoor,
    /// The daemon's API (`POST /v1/tenants/{name}/infer`, the tenant's token).
    Api,
}

impl Door {
    /// In words, for findings.
    pub fn describe(self) -> &'static str {
        match self {
            Door::FrontDoor => "through the front door with inference keys, as clients call",
            Door::Api => {
                "through the daemon's API infer route (no --front-door given: clients' own door not timed)"
            }
        }
    }
}

/// One caller of a probe: its name and the secret it calls with.
#[derive(Debug, Clone)]
pub struct ProbeCaller {
    /// The probe tenant.
    pub name: String,
    /// Which door.
    pub door: Door,
    secret: String,
}

impl ProbeCaller {
    /// As the host's [`Caller`].
    pub fn caller(&self) -> Caller<'_> {
        match self.door {
            Door::FrontDoor => Caller::Key(&self.secret),
            Door::Api => Caller::Token(&self.secret),
        }
    }
}

/// `n` callers of probe `name` (tenant token `token`): `n` inference keys of its own at the
/// front door when the host has one (each a different principal of the same tenant), else
/// its token `n` times on the API.
pub fn callers(
    host: &dyn VerifyHost,
    name: &str,
    token: &str,
    n: usize,
) -> Result<Vec<ProbeCaller>, HostError> {
    let first = host.inference_key(name, token)?;
    let door = match host.front_door(&first, "/v1/models", None) {
        Ok((200, _)) => Door::FrontDoor,
        Ok((status, body)) => {
            return Err(HostError::Api {
                status,
                message: format!(
                    "the front door refused probe {name}'s own key: {}",
                    crate::untrusted::one_line(&body)
                ),
            })
        }
        Err(HostError::Unsupported(_)) => Door::Api,
        Err(e) => return Err(e),
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let secret = match (door, i) {
            (Door::Api, _) => token.to_string(),
            (Door::FrontDoor, 0) => first.clone(),
            (Door::FrontDoor, _) => host.inference_key(name, token)?,
        };
        out.push(ProbeCaller {
            name: name.to_string(),
            door,
            secret,
        });
    }
    Ok(out)
}
