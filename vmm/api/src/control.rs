//! The control socket of `tenantvm-vmm` (docs/vmm.md, "Control socket"): a Unix stream
//! socket speaking newline-delimited JSON, one request per line and one response line
//! each. The VMM parses requests with [`parse_request`] and writes [`VmResponse`] lines;
//! the orchestrator writes [`VmCommand`] lines and parses the responses with
//! [`VmResponse::parse`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Longest line either side accepts, newline excluded (requests and responses).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// A run-time command: one line of JSON on the control socket, e.g. `{"command":"pause"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "lowercase", deny_unknown_fields)]
pub enum VmCommand {
    /// Report the VM's state ([`VmResponse::Status`]).
    Status,
    /// Stop all vCPUs at their next exit; the VM keeps its state ([`VmResponse::Done`]).
    Pause,
    /// Let paused vCPUs run again ([`VmResponse::Done`]).
    Resume,
    /// Stop the VM; the process exits with status 6 ([`VmResponse::Done`] first).
    Shutdown,
    /// Report every device counter ([`VmResponse::Metrics`]).
    Metrics,
}

impl VmCommand {
    /// Every command, in the order the documentation lists them.
    pub const ALL: [VmCommand; 5] = [
        VmCommand::Status,
        VmCommand::Pause,
        VmCommand::Resume,
        VmCommand::Shutdown,
        VmCommand::Metrics,
    ];

    /// The command's name on the wire.
    pub const fn name(self) -> &'static str {
        match self {
            VmCommand::Status => "status",
            VmCommand::Pause => "pause",
            VmCommand::Resume => "resume",
            VmCommand::Shutdown => "shutdown",
            VmCommand::Metrics => "metrics",
        }
    }

    /// The request as one JSON line, newline included.
    pub fn to_line(self) -> String {
        format!("{{\"command\":\"{}\"}}\n", self.name())
    }
}

/// Whether the vCPUs are running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// The vCPUs run.
    Running,
    /// The vCPUs are parked.
    Paused,
}

/// One response line. Every response has `ok`; the other fields say which kind it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum VmResponse {
    /// `status` succeeded.
    Status {
        /// Always true.
        ok: bool,
        /// Running or paused.
        state: VmState,
        /// vCPU count.
        vcpus: u32,
        /// Guest RAM in MiB.
        memory_mib: u64,
        /// Milliseconds since the vCPUs started.
        uptime_ms: u64,
        /// The VMM's process id (in its own pid namespace when jailed).
        pid: u32,
    },
    /// `pause`, `resume` or `shutdown` succeeded.
    Done {
        /// Always true.
        ok: bool,
        /// The state after the command.
        state: VmState,
    },
    /// `metrics` succeeded.
    Metrics {
        /// Always true.
        ok: bool,
        /// Counters by device name (`pci`, `disk0`, `disk0.transport`, `vsock`, ...), then
        /// by counter name (docs/devices.md).
        devices: BTreeMap<String, BTreeMap<String, u64>>,
    },
    /// The request was refused.
    Error {
        /// Always false.
        ok: bool,
        /// What was wrong and what to send instead.
        error: String,
    },
}

impl VmResponse {
    /// An error response.
    pub fn error(message: impl Into<String>) -> Self {
        VmResponse::Error {
            ok: false,
            error: message.into(),
        }
    }

    /// The response as one JSON line, newline included.
    pub fn to_line(&self) -> String {
        // Serialising these plain structs cannot fail; fall back to a fixed error anyway.
        let mut line = serde_json::to_string(self)
            .unwrap_or_else(|_| r#"{"ok":false,"error":"Internal serialisation error"}"#.into());
        line.push('\n');
        line
    }

    /// Parses one response line (the peer is untrusted: cap the line at
    /// [`MAX_LINE_BYTES`] before calling this). An object that fits no response kind, or
    /// whose `ok` contradicts its kind, is an error.
    pub fn parse(line: &[u8]) -> Result<Self, serde_json::Error> {
        let response: VmResponse = serde_json::from_slice(line)?;
        let consistent = match &response {
            VmResponse::Status { ok, .. }
            | VmResponse::Done { ok, .. }
            | VmResponse::Metrics { ok, .. } => *ok,
            VmResponse::Error { ok, .. } => !*ok,
        };
        if consistent {
            Ok(response)
        } else {
            Err(serde::de::Error::custom(
                "the response's \"ok\" contradicts its other fields",
            ))
        }
    }
}

/// The wire form of a request: exactly one field.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    command: String,
}

/// Parses one request line into a command, or an error response that says what is wrong.
pub fn parse_request(line: &[u8]) -> Result<VmCommand, VmResponse> {
    let request: Request = serde_json::from_slice(line).map_err(|e| {
        VmResponse::error(format!(
            "Malformed request ({e}); send one JSON object per line, e.g. \
             {{\"command\":\"status\"}}"
        ))
    })?;
    VmCommand::ALL
        .into_iter()
        .find(|c| c.name() == request.command)
        .ok_or_else(|| {
            VmResponse::error(format!(
                "Unknown command {:?}; commands are status, pause, resume, shutdown, metrics",
                request.command
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_line_parses_back_to_itself() {
        for command in VmCommand::ALL {
            let line = command.to_line();
            assert!(line.ends_with('\n'));
            assert_eq!(parse_request(line.trim_end().as_bytes()), Ok(command));
            assert_eq!(
                serde_json::from_str::<VmCommand>(&line).unwrap(),
                command,
                "{line}"
            );
        }
        assert_eq!(
            parse_request(br#" {"command":"shutdown"} "#),
            Ok(VmCommand::Shutdown)
        );
    }

    #[test]
    fn unknown_command_extra_field_and_garbage_are_errors() {
        for bad in [
            &br#"{"command":"reboot"}"#[..],
            br#"{"command":"status","x":1}"#,
            b"not json",
            b"",
            b"\xff\xfe",
        ] {
            let err = parse_request(bad).unwrap_err();
            assert!(
                matches!(err, VmResponse::Error { ok: false, .. }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn responses_round_trip_through_their_lines() {
        let all = [
            VmResponse::Status {
                ok: true,
                state: VmState::Paused,
                vcpus: 2,
                memory_mib: 128,
                uptime_ms: 5,
                pid: 42,
            },
            VmResponse::Done {
                ok: true,
                state: VmState::Running,
            },
            VmResponse::Metrics {
                ok: true,
                devices: BTreeMap::from([(
                    "disk0".to_string(),
                    BTreeMap::from([("read_bytes".to_string(), 7)]),
                )]),
            },
            VmResponse::error("no"),
        ];
        for response in all {
            let line = response.to_line();
            assert_eq!(VmResponse::parse(line.as_bytes()).unwrap(), response);
        }
        let v: serde_json::Value = serde_json::from_str(
            &VmResponse::Status {
                ok: true,
                state: VmState::Paused,
                vcpus: 2,
                memory_mib: 128,
                uptime_ms: 5,
                pid: 42,
            }
            .to_line(),
        )
        .unwrap();
        assert_eq!(v["state"], "paused");
        assert_eq!(v["memory_mib"], 128);
    }

    #[test]
    fn inconsistent_or_foreign_responses_are_refused() {
        for bad in [
            &br#"{"ok":false,"state":"running"}"#[..],
            br#"{"ok":true,"error":"x"}"#,
            br#"{"ok":true,"state":"exploded"}"#,
            br#"[1,2]"#,
            br#"{"return":{}}"#,
        ] {
            assert!(VmResponse::parse(bad).is_err(), "{bad:?}");
        }
    }
}
