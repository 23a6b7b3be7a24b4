//! A test-only fault hook: make the daemon die at a chosen step boundary.
//!
//! `TENANTVM_TEST_CRASH_AT=<op>:<step>:<before|after>` (e.g. `create:launch-vm:after`)
//! makes the daemon SIGKILL itself when it reaches that boundary, so the crash-safety tests
//! can stop it at every boundary of create and destroy, systematically. This module exists
//! only in unit tests and in builds with the `test-hooks` feature (which the test command
//! enables for the binaries the integration tests launch); a production build has no hook.
//! Even then it is inert unless the variable is set, and the daemon logs a loud warning when
//! it is. In-process tests use [`FaultHook::fail_at`], which returns an error instead of
//! dying.

use thiserror::Error;

pub use crate::tenant::runner::Boundary;

/// Name of the environment variable that arms the hook.
pub const CRASH_ENV: &str = "TENANTVM_TEST_CRASH_AT";

/// A malformed hook setting, or the simulated crash itself.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FaultError {
    /// The variable does not have the form `<op>:<step>:<before|after>`.
    #[error(
        "{CRASH_ENV} must look like `create:launch-vm:after` (op:step:before|after), got {0:?}"
    )]
    BadSetting(String),
    /// An in-process simulated crash.
    #[error("Simulated crash at {op}:{step}:{boundary}")]
    Crashed {
        /// The operation.
        op: String,
        /// The step.
        step: String,
        /// `before` or `after`.
        boundary: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Kill,
    Fail,
}

/// Where (if anywhere) to crash.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FaultHook {
    target: Option<(String, String, Boundary, Mode)>,
}

impl FaultHook {
    /// Reads [`CRASH_ENV`]; unset means inert.
    pub fn from_env() -> Result<FaultHook, FaultError> {
        match std::env::var(CRASH_ENV) {
            Ok(v) if !v.is_empty() => {
                let (op, step, b) = parse(&v)?;
                Ok(FaultHook {
                    target: Some((op, step, b, Mode::Kill)),
                })
            }
            _ => Ok(FaultHook::default()),
        }
    }

    /// A hook that returns [`FaultError::Crashed`] at the boundary instead of killing the
    /// process, for in-process tests.
    pub fn fail_at(op: &str, step: &str, boundary: Boundary) -> FaultHook {
        FaultHook {
            target: Some((op.into(), step.into(), boundary, Mode::Fail)),
        }
    }

    /// Whether the hook is armed.
    pub fn is_armed(&self) -> bool {
        self.target.is_some()
    }

    /// Called at every step boundary.
    pub fn check(&self, op: &str, step: &str, boundary: Boundary) -> Result<(), FaultError> {
        let Some((t_op, t_step, t_b, mode)) = &self.target else {
            return Ok(());
        };
        if t_op != op || t_step != step || *t_b != boundary {
            return Ok(());
        }
        match mode {
            Mode::Kill => {
                tracing::error!(op, step, ?boundary, "test fault hook: SIGKILL to self");
                // SAFETY: kill(2) on our own pid with a valid signal number has no memory
                // effects; SIGKILL cannot be caught, so this does not return.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                unreachable!("SIGKILL to self returned");
            }
            Mode::Fail => Err(FaultError::Crashed {
                op: op.into(),
                step: step.into(),
                boundary: match boundary {
                    Boundary::Before => "before",
                    Boundary::After => "after",
                },
            }),
        }
    }
}

fn parse(v: &str) -> Result<(String, String, Boundary), FaultError> {
    let bad = || FaultError::BadSetting(v.to_string());
    let mut parts = v.split(':');
    let (Some(op), Some(step), Some(b), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if op.is_empty() || step.is_empty() {
        return Err(bad());
    }
    let b = match b {
        "before" => Boundary::Before,
        "after" => Boundary::After,
        _ => return Err(bad()),
    };
    Ok((op.into(), step.into(), b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_op_step_boundary() {
        assert_eq!(
            parse("create:launch-vm:after").unwrap(),
            ("create".into(), "launch-vm".into(), Boundary::After)
        );
        for bad in [
            "",
            "create",
            "create:x",
            "create:x:during",
            "a:b:before:c",
            ":x:before",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn inert_hook_never_fires() {
        let hook = FaultHook::default();
        assert!(!hook.is_armed());
        hook.check("create", "launch-vm", Boundary::After).unwrap();
    }

    #[test]
    fn fail_hook_fires_only_at_its_boundary() {
        let hook = FaultHook::fail_at("create", "launch-vm", Boundary::After);
        hook.check("create", "launch-vm", Boundary::Before).unwrap();
        hook.check("destroy", "launch-vm", Boundary::After).unwrap();
        assert!(matches!(
            hook.check("create", "launch-vm", Boundary::After),
            Err(FaultError::Crashed { .. })
        ));
    }
}
