//! How a command fails: [`CliFailure`], an exit status with its message, and the mapping
//! of each error (the daemon's answers, I/O, receipts, GPU tools) onto [`exit`](super::exit).

use super::exit;
use crate::client::ClientError;

/// A failure with its exit status.
#[derive(Debug)]
pub struct CliFailure {
    /// Exit status.
    pub code: u8,
    /// What to print (nothing when empty).
    pub message: String,
}

impl CliFailure {
    /// The reader of the output went away: stop quietly.
    pub(super) fn broken_pipe() -> Self {
        CliFailure {
            code: exit::BROKEN_PIPE,
            message: String::new(),
        }
    }
}

/// Whether `e` or one of its sources is a write to a pipe nobody reads any more.
pub(super) fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::BrokenPipe {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

impl From<std::io::Error> for CliFailure {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return CliFailure::broken_pipe();
        }
        fail(exit::OTHER, format!("Cannot write the output: {e}"))
    }
}

impl From<crate::receipt::ReceiptError> for CliFailure {
    fn from(e: crate::receipt::ReceiptError) -> Self {
        if is_broken_pipe(&e) {
            return CliFailure::broken_pipe();
        }
        fail(exit::OTHER, e.to_string())
    }
}

impl From<ClientError> for CliFailure {
    fn from(e: ClientError) -> Self {
        let code = match &e {
            ClientError::Connect { .. } => exit::UNREACHABLE,
            ClientError::Api { status, .. } | ClientError::Decode { status, .. } => {
                match status.as_u16() {
                    401 => exit::UNAUTHORIZED,
                    403 => exit::FORBIDDEN,
                    404 => exit::NOT_FOUND,
                    409 => exit::CONFLICT,
                    429 => exit::QUOTA,
                    400 | 411 | 413 | 415 | 422 => exit::INVALID,
                    507 => exit::NO_SPACE,
                    500..=599 => exit::DAEMON_ERROR,
                    _ => exit::OTHER,
                }
            }
            ClientError::Http(_) => exit::OTHER,
        };
        // The daemon's messages may quote guests (agent and payload errors): one line.
        CliFailure {
            code,
            message: crate::untrusted::one_line(&e.to_string()),
        }
    }
}

/// A failure with status `code` saying `message`.
pub(super) fn fail(code: u8, message: impl Into<String>) -> CliFailure {
    CliFailure {
        code,
        message: message.into(),
    }
}

/// The status and message of a failed GPU tool (`plan`, `host check`).
pub(super) fn gpu_failure(e: tenantvm_gpu::cli::GpuCliError) -> CliFailure {
    use tenantvm_gpu::cli::GpuCliError as G;
    if is_broken_pipe(&e) {
        return CliFailure::broken_pipe();
    }
    let code = match e {
        G::Usage(_) | G::Tenants(_) | G::Database(_) | G::MigParted(_) => exit::INVALID,
        _ => exit::OTHER,
    };
    fail(code, e.to_string())
}
