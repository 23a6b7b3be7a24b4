//! Commands the VMM accepts at run time, and their responses (docs/vmm.md, "Control socket").

use serde::{Deserialize, Serialize};

/// A run-time command: one line of JSON on the control socket, e.g. `{"command":"pause"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "lowercase", deny_unknown_fields)]
pub enum VmCommand {
    /// Report the VM's state.
    Status,
    /// Stop all vCPUs at their next exit; the VM keeps its state.
    Pause,
    /// Let paused vCPUs run again.
    Resume,
    /// Stop the VM; the process exits with status 6.
    Shutdown,
    /// Report every device counter.
    Metrics,
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

/// One response line.
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
        /// The VMM's process id.
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
        /// Counters by device name (`pci`, `disk0`, `disk0.transport`, `vsock`, ...).
        devices: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
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
    match request.command.as_str() {
        "status" => Ok(VmCommand::Status),
        "pause" => Ok(VmCommand::Pause),
        "resume" => Ok(VmCommand::Resume),
        "shutdown" => Ok(VmCommand::Shutdown),
        "metrics" => Ok(VmCommand::Metrics),
        other => Err(VmResponse::error(format!(
            "Unknown command {other:?}; commands are status, pause, resume, shutdown, metrics"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_commands_parse() {
        assert_eq!(
            parse_request(br#"{"command":"status"}"#),
            Ok(VmCommand::Status)
        );
        assert_eq!(
            parse_request(br#" {"command":"shutdown"} "#),
            Ok(VmCommand::Shutdown)
        );
        assert_eq!(
            parse_request(br#"{"command":"metrics"}"#),
            Ok(VmCommand::Metrics)
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
    fn status_response_has_documented_fields() {
        let r = VmResponse::Status {
            ok: true,
            state: VmState::Paused,
            vcpus: 2,
            memory_mib: 128,
            uptime_ms: 5,
            pid: 42,
        };
        let v: serde_json::Value = serde_json::from_str(&r.to_line()).unwrap();
        assert_eq!(v["state"], "paused");
        assert_eq!(v["ok"], true);
        assert_eq!(v["memory_mib"], 128);
    }
}
