//! The node's tenantvmd, through its admin API on the Unix socket (the `tenantvm` CLI's own
//! client), with a deadline on every call: a daemon that is down answers at once with a
//! refused connection, one that is wedged (stopped, swapping, stuck) never answers, and
//! neither may hold the node agent.

use std::future::Future;
use std::time::Duration;

use tenantvm::client::{Client, ClientError};

/// Why a call to tenantvmd failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DaemonError {
    /// No connection, or the exchange broke off.
    #[error("tenantvmd is down: {0}")]
    Down(String),
    /// It did not answer within the deadline.
    #[error("tenantvmd did not answer within {0:?}: wedged or overloaded")]
    Wedged(Duration),
    /// It answered with an error.
    #[error("tenantvmd refused ({status} {code}): {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The API's error code.
        code: String,
        /// Its message.
        message: String,
    },
}

impl DaemonError {
    /// Whether the daemon could not be asked at all (down or wedged).
    pub fn unreachable(&self) -> bool {
        matches!(self, DaemonError::Down(_) | DaemonError::Wedged(_))
    }

    /// The condition reason: `Down`, `Wedged` or `Refused`.
    pub fn reason(&self) -> &'static str {
        match self {
            DaemonError::Down(_) => "Down",
            DaemonError::Wedged(_) => "Wedged",
            DaemonError::Refused { .. } => "Refused",
        }
    }

    /// Whether it is the API's 404.
    pub fn not_found(&self) -> bool {
        matches!(self, DaemonError::Refused { status: 404, .. })
    }
}

/// The daemon with a deadline per call.
#[derive(Debug, Clone)]
pub struct Daemon {
    /// The admin client.
    pub client: Client,
    /// The deadline of one call.
    pub timeout: Duration,
}

impl Daemon {
    /// Runs one call of [`Daemon::client`] under the deadline.
    pub async fn call<T>(
        &self,
        call: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, DaemonError> {
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(DaemonError::Wedged(self.timeout)),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(ClientError::Api {
                status,
                code,
                message,
            })) => Err(DaemonError::Refused {
                status: status.as_u16(),
                code,
                message,
            }),
            Ok(Err(e)) => Err(DaemonError::Down(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_daemon_that_never_answers_is_wedged_and_one_absent_is_down() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        // Listening, never accepting: the connect succeeds, the answer never comes.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let d = Daemon {
            client: Client::new(&path, "t"),
            timeout: Duration::from_millis(300),
        };
        let e = d.call(d.client.health()).await.unwrap_err();
        assert!(matches!(e, DaemonError::Wedged(_)), "{e}");
        assert!(e.unreachable());
        let gone = Daemon {
            client: Client::new(dir.path().join("none.sock"), "t"),
            timeout: Duration::from_secs(30),
        };
        let e = gone.call(gone.client.health()).await.unwrap_err();
        assert!(matches!(e, DaemonError::Down(_)), "{e}");
    }
}
